"""The selection rule: protection, whole-group eviction, the fallback to finer eviction, exact budgets."""

import pytest
import torch

from kvchat.core.cache.groups import ends_group, select_keep, sentence_ids


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
    assert [k.tolist() for k in keep] == [[1, 2, 4]]  # protected slot 1 despite its low score; ascending order


def test_group_mode_evicts_whole_groups_and_cuts_only_the_last_one():
    # groups: A=[0,1] B=[2,3,4] C=[5,6] D=[7]; recency scores (newer = better)
    scores = torch.arange(8.0)[None]
    groups = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 3]])
    protected = torch.zeros(1, 8, dtype=torch.bool)
    keep = select_keep(scores, 4, protected, groups)
    # D (7) and C (6.5 mean... 5,6) fit: 3 slots; B does not fit whole -> its best token (4) fills the budget.
    assert [k.tolist() for k in keep] == [[4, 5, 6, 7]]
    keep = select_keep(scores, 6, protected, groups)
    assert [k.tolist() for k in keep] == [[2, 3, 4, 5, 6, 7]]


def test_group_score_is_mean_of_unprotected_tokens():
    scores = torch.tensor([[10.0, 0.0, 0.0, 4.0, 4.0, 0.0]])
    groups = torch.tensor([[0, 0, 0, 1, 1, 2]])
    protected = torch.tensor([[False, False, False, False, False, True]])
    # mean(group0)=3.33 < mean(group1)=4 -> group1 first, then the best token of group0.
    keep = select_keep(scores, 4, protected, groups)
    assert [k.tolist() for k in keep] == [[0, 3, 4, 5]]
    keep_max = select_keep(scores, 4, protected, groups, aggregate="max")
    assert [k.tolist() for k in keep_max] == [[0, 1, 2, 5]]


@pytest.mark.parametrize("mode", [None, "groups"])
def test_exact_budget_per_head(mode):
    torch.manual_seed(0)
    scores = torch.randn(3, 50)
    groups = torch.randint(0, 7, (1, 50)).sort().values.expand(3, -1) if mode else None
    protected = torch.zeros(3, 50, dtype=torch.bool)
    protected[:, :4] = True
    protected[:, -5:] = True
    keep = select_keep(scores, 20, protected, groups)
    assert [k.numel() for k in keep] == [20, 20, 20]
    for h in range(3):
        row = keep[h].tolist()
        assert row == sorted(set(row))
        assert set(range(4)) | set(range(45, 50)) <= set(row)


def test_nothing_to_evict_returns_everything():
    keep = select_keep(torch.zeros(2, 5), 9, torch.zeros(2, 5, dtype=torch.bool))
    assert [k.tolist() for k in keep] == [list(range(5))] * 2


def test_per_head_counts_and_padded_heads():
    """Heads of different lengths (padded, ``valid``) each keep their own number of positions."""
    scores = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [9.0, 8.0, 7.0, 0.0, 0.0]])
    valid = torch.tensor([[True] * 5, [True, True, True, False, False]])
    protected = torch.zeros(2, 5, dtype=torch.bool)
    keep = select_keep(scores, [2, 5], protected, valid=valid)
    assert [k.tolist() for k in keep] == [[1, 3], [0, 1, 2]]  # a head never keeps padding
    groups = torch.tensor([[0, 0, 1, 1, 2], [0, 1, 1, -1, -1]])
    keep = select_keep(scores, [3, 2], protected, groups, valid=valid)
    # head 0: group 1 (mean 3.5) whole, then the best token of group 0; head 1: group 0, then group 1 cut
    assert [k.tolist() for k in keep] == [[1, 2, 3], [0, 1]]


def test_the_groups_a_compression_gave_up_are_counted_without_reading_back():
    """The evicted-groups statistic of a compression stays on the device until the turn closes; it counts the groups
    the first head held (dropped and empty slots aside) and kept nothing of."""
    from kvchat.core.cache.compress import Evictions, Plan, groups_given_up
    from kvchat.policies import LayerView

    positions = torch.tensor([[3, 4, 5, 6, 7, 8, 9, -1]])
    valid = torch.tensor([[True, True, True, True, False, True, True, False]])  # slot 4 dropped, slot 7 empty
    groups = torch.tensor([[0, 0, 1, 1, 2, 3, 3, -1]])
    view = LayerView(0, positions, valid, torch.zeros(1, 1, 8, 4), groups=groups)
    plan = Plan(None, view, [2], index=torch.tensor([[1, 5, 8]]), kept=[2])  # keeps slots 1 and 5: groups 0 and 3
    given_up = groups_given_up(plan)
    assert isinstance(given_up, torch.Tensor) and int(given_up) == 1  # held 0, 1, 3 (2 was dropped): 1 gone
    view.groups = None  # per token: the 6 held positions, 2 kept
    assert int(groups_given_up(plan)) == 4
    evictions = Evictions()
    evictions.record({"evicted_tokens": 4, "evicted_groups": groups_given_up(plan)})
    evictions.record({"evicted_tokens": 1, "evicted_groups": 1})
    counts = [e["evicted_groups"] for e in evictions.take()]  # read back, all at once, as the turn closes
    assert counts == [4, 1] and all(type(n) is int for n in counts) and evictions.events == []
