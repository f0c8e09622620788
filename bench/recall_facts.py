"""The facts ``kvchat bench recall`` plants: (the fact's sentence, the direct question, a paraphrased question, the
reference answer, a random value, the fact's family). ``FACTS`` are the bench's own; ``HELDOUT`` (``--facts
heldout``) are other facts in other wording, never used to tune recall, for a check on conversations it has not
seen. A distractor case plants two more facts of the same family beside the asked one."""

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
    ("The vet said the dog weighs {v} kilos.", "How much does the dog weigh?", "What did the vet say about Rex's weight?",
     "The dog weighs {v} kilos.", lambda r: str(r.randint(12, 48)), "number"),
    ("My insurance policy number is {v}.", "What is my insurance policy number?",
     "Which reference do I quote when I call the insurer?", "Your policy number is {v}.",
     lambda r: f"{r.choice(['HX', 'QL', 'ZT'])}-{r.randint(10000, 99999)}", "secret"),
]
FACT_SETS = {"bench": FACTS, "heldout": HELDOUT}
