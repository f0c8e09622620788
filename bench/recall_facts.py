"""The facts ``kvchat bench recall`` plants: (the fact's sentence, the direct question, a paraphrased question, the
reference answer, a random value, the fact's family). ``FACTS`` are the bench's own; ``HELDOUT`` (``--facts
heldout``) are other facts in other wording, never used to tune recall, for a check on conversations it has not
seen; ``--facts FILE`` takes a person's own (``load``). A distractor case plants two more facts of the same family
beside the asked one."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: What each line of a ``--facts`` file holds (JSON objects, one a line): the sentences' ``{v}`` is the value.
FIELDS = {"fact": "the sentence planted, with {v}", "question": "the direct question",
          "paraphrase": "the question in other words", "answer": "the reference answer, with {v}",
          "values": "two or more values, one drawn per case", "family": "optional: facts of one family are each "
          "other's distractors"}

FACTS = [
    ("My bike lock code is {v}.", "What is my bike lock code?", "Which numbers open the lock on my bicycle?",
     "Your bike lock code is {v}.", lambda r: str(r.randint(1000, 9999)), "code"),
    ("My locker code is {v}.", "What is my locker code?", "Which combination opens my locker at the gym?",
     "Your locker code is {v}.", lambda r: str(r.randint(1000, 9999)), "code"),
    ("My phone PIN is {v}.", "What is my phone PIN?", "What do I type to unlock my mobile?",
     "Your phone PIN is {v}.", lambda r: str(r.randint(1000, 9999)), "code"),
    ("I parked the car on level {v} of the garage.", "Which level of the garage did I park on?",
     "Where did I leave the car?", "You parked on level {v}.", lambda r: str(r.randint(2, 9)), "place"),
    ("My sister's name is {v}.", "What is my sister's name?", "What is my sibling called?",
     "Your sister's name is {v}.",
     lambda r: r.choice(["Margaret", "Beatrice", "Eleanor", "Harriet", "Josephine", "Clementine"]), "name"),
    ("My dentist is called Dr. {v}.", "What is my dentist called?", "Who looks after my teeth?",
     "Your dentist is Dr. {v}.", lambda r: r.choice(["Okafor", "Lindqvist", "Moreau", "Tanaka", "Petrov"]), "name"),
    ("The team meeting is in {v}.", "Where is the team meeting?", "In which city do my colleagues and I gather?",
     "The team meeting is in {v}.", lambda r: r.choice(["Lisbon", "Nairobi", "Winnipeg", "Osaka", "Tbilisi"]),
     "place"),
    ("My flight number is {v}.", "What is my flight number?", "Which plane am I booked on?",
     "Your flight number is {v}.", lambda r: f"{r.choice(['KL', 'AF', 'LH', 'BA'])}{r.randint(100, 999)}", "code"),
]

# A second set, never used to tune recall (``--facts heldout``): other facts, other wording, its own distractors.
HELDOUT = [
    ("The spare key is hidden under the {v} flowerpot.", "Where is the spare key hidden?",
     "If I lock myself out, where do I look?", "Under the {v} flowerpot.",
     lambda r: r.choice(["blue", "cracked", "tallest", "terracotta", "square"]), "spot"),
    ("My library card number is {v}.", "What is my library card number?", "What do I show to borrow books?",
     "Your library card number is {v}.", lambda r: str(r.randint(100000, 999999)), "number"),
    ("Our wifi password is {v}.", "What is our wifi password?", "How do guests get online at our place?",
     "The wifi password is {v}.", lambda r: r.choice(["marmalade42", "orbit-77", "quiet_fox9", "tulip2024"]),
     "secret"),
    ("My grandmother was born in {v}.", "Where was my grandmother born?", "Which town does Granny come from?",
     "Your grandmother was born in {v}.", lambda r: r.choice(["Valparaiso", "Trondheim", "Kumasi", "Brno", "Hue"]),
     "spot"),
    ("The boiler service is booked for {v}.", "When is the boiler service booked?",
     "On which day does the heating engineer come?", "It is booked for {v}.",
     lambda r: r.choice(["Tuesday the 14th", "March 3rd", "next Friday", "the 27th"]), "date"),
    ("My locker at work is number {v}.", "What is my locker number at work?",
     "Where do I keep my things at the office?", "Locker number {v}.", lambda r: str(r.randint(10, 399)), "number"),
    ("The vet said the dog weighs {v} kilos.", "How much does the dog weigh?",
     "What did the vet say about Rex's weight?", "The dog weighs {v} kilos.", lambda r: str(r.randint(12, 48)),
     "number"),
    ("My insurance policy number is {v}.", "What is my insurance policy number?",
     "Which reference do I quote when I call the insurer?", "Your policy number is {v}.",
     lambda r: f"{r.choice(['HX', 'QL', 'ZT'])}-{r.randint(10000, 99999)}", "secret"),
]
FACT_SETS = {"bench": FACTS, "heldout": HELDOUT}


def load(spec: str) -> list[tuple]:
    """The facts ``--facts`` names: a set's name, or a JSONL file of the fields ``FIELDS`` (a ValueError of one line
    names the first bad line)."""
    if spec in FACT_SETS:
        return FACT_SETS[spec]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"{spec}: neither {' nor '.join(FACT_SETS)} nor a file")
    facts = []
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{no}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{no}: a line holds one JSON object")
        need = [k for k in FIELDS if k != "family" and k not in row]
        if need:
            fields = "; ".join(f"{k}: {v}" for k, v in FIELDS.items())
            raise ValueError(f"{path}:{no}: missing {', '.join(need)} ({fields})")
        texts = [row[k] for k in ("fact", "question", "paraphrase", "answer")]
        if not all(isinstance(t, str) and t.strip() for t in texts):
            raise ValueError(f"{path}:{no}: fact, question, paraphrase and answer must be non-empty text")
        if "{v}" not in row["fact"] or "{v}" not in row["answer"]:
            raise ValueError(f"{path}:{no}: the fact and the answer must each hold {{v}}, where the value goes")
        values = row["values"]
        if not isinstance(values, list) or len({str(v) for v in values}) < 2 or \
                not all(str(v).strip() for v in values):
            raise ValueError(f"{path}:{no}: values must list two or more different, non-empty values")
        try:
            row["fact"].format(v=""), row["answer"].format(v="")
        except (IndexError, KeyError, ValueError):
            raise ValueError(f"{path}:{no}: braces other than {{v}} must be doubled ({{{{ and }}}})") from None
        choices = sorted({str(v) for v in values})
        facts.append((row["fact"], row["question"], row["paraphrase"], row["answer"],
                      lambda r, choices=choices: r.choice(choices), str(row.get("family", f"line {no}"))))
    if not facts:
        raise ValueError(f"{path}: no facts in it")
    return facts



def argument(spec: str) -> str:
    """``--facts`` as argparse takes it: checked as it is parsed (a file's first bad line is the error), kept as
    given."""
    try:
        load(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec
