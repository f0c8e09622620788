"""The selection rule: protection, whole-group eviction, the fallback to finer eviction, exact budgets."""

import pytest
import torch

from kvchat.core.groups import ends_group, select_keep, sentence_ids


def test_sentence_boundaries():
    assert ends_group(".") and ends_group(" end.") and ends_group("!\"") and ends_group("?)") and ends_group("\n")
    assert ends_group("。")
    assert not ends_group(" word") and not ends_group("3.14")
    assert not ends_group(",") and not ends_group(" Mr")


def test_sentence_ids_split_at_punctuation_and_messages():
    ids, last, start_new = sentence_ids(["Hi", ".", " How", " are", " you", "?", " Fine"], 0, True)
    assert ids == [1, 1, 2, 2, 2, 2, 3]
    assert (last, start_new) == (3, False)
    # A new message always opens a group, even mid-sentence.
    ids2, last, _ = sentence_ids(["more"], last, True)
    assert ids2 == [4]


def test_token_mode_keeps_top_scores_and_protected():
    scores = torch.tensor([[5.0, 1.0, 9.0, 2.0, 8.0, 0.0]])
    protected = torch.tensor([[False, True, False, False, False, False]])
    keep = select_keep(scores, 3, protected)
    assert keep.tolist() == [[1, 2, 4]]  # protected slot 1 despite its low score; ascending order


def test_group_mode_evicts_whole_groups_and_cuts_only_the_last_one():
    # groups: A=[0,1] B=[2,3,4] C=[5,6] D=[7]; recency scores (newer = better)
    scores = torch.arange(8.0)[None]
    groups = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 3]])
    protected = torch.zeros(1, 8, dtype=torch.bool)
    keep = select_keep(scores, 4, protected, groups)
    # D (7) and C (6.5 mean... 5,6) fit: 3 slots; B does not fit whole -> its best token (4) fills the budget.
    assert keep.tolist() == [[4, 5, 6, 7]]
    keep = select_keep(scores, 6, protected, groups)
    assert keep.tolist() == [[2, 3, 4, 5, 6, 7]]


def test_group_score_is_mean_of_unprotected_tokens():
    scores = torch.tensor([[10.0, 0.0, 0.0, 4.0, 4.0, 0.0]])
    groups = torch.tensor([[0, 0, 0, 1, 1, 2]])
    protected = torch.tensor([[False, False, False, False, False, True]])
    # mean(group0)=3.33 < mean(group1)=4 -> group1 first, then the best token of group0.
    keep = select_keep(scores, 4, protected, groups)
    assert keep.tolist() == [[0, 3, 4, 5]]
    keep_max = select_keep(scores, 4, protected, groups, aggregate="max")
    assert keep_max.tolist() == [[0, 1, 2, 5]]


@pytest.mark.parametrize("mode", [None, "groups"])
def test_exact_budget_per_head(mode):
    torch.manual_seed(0)
    scores = torch.randn(3, 50)
    groups = torch.randint(0, 7, (1, 50)).sort().values.expand(3, -1) if mode else None
    protected = torch.zeros(3, 50, dtype=torch.bool)
    protected[:, :4] = True
    protected[:, -5:] = True
    keep = select_keep(scores, 20, protected, groups)
    assert keep.shape == (3, 20)
    for h in range(3):
        row = keep[h].tolist()
        assert row == sorted(set(row))
        assert set(range(4)) | set(range(45, 50)) <= set(row)


def test_nothing_to_evict_returns_everything():
    keep = select_keep(torch.zeros(2, 5), 9, torch.zeros(2, 5, dtype=torch.bool))
    assert keep.tolist() == [list(range(5))] * 2
