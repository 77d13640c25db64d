"""Seeded programmatic prompt generators: the embedded corpus that needs no files and no network.

Each family turns a `random.Random` into one user prompt. Output depends only on (seed, n, families, weights):
`random.Random` with an int seed is stable across Python 3 versions, and we never iterate over sets.
"""
from __future__ import annotations

import hashlib
import random

NAMES = ["Ava", "Ben", "Chloe", "Diego", "Elif", "Farah", "Gus", "Hana", "Ivan", "Jun", "Kofi", "Lena", "Mateo",
         "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara", "Uma", "Victor", "Wen", "Yusuf", "Zoe"]
ITEMS = [("apple", "apples"), ("book", "books"), ("marble", "marbles"), ("sticker", "stickers"),
         ("cupcake", "cupcakes"), ("pencil", "pencils"), ("coin", "coins"), ("shell", "shells"),
         ("ticket", "tickets"), ("plant", "plants"), ("card", "cards"), ("cookie", "cookies")]
UNITS = [("hour", "hours"), ("day", "days"), ("week", "weeks")]
JOBS = ["tutoring", "walking dogs", "mowing lawns", "washing cars", "babysitting", "painting fences"]
SHOPS = ["bakery", "bookstore", "farmers market", "hardware store", "toy shop", "cafe"]


def _math(rng: random.Random) -> str:
    name, other = rng.sample(NAMES, 2)
    item, items = rng.choice(ITEMS)
    a, b, c = rng.randint(3, 60), rng.randint(2, 12), rng.randint(2, 9)
    price = rng.choice([0.25, 0.5, 0.75, 1.25, 2, 3, 4.5, 5, 12])
    unit, units = rng.choice(UNITS)
    kind = rng.randrange(8)
    if kind == 0:
        return (f"{name} has {a} {items}. {other} gives {name} {b} more, and then {name} gives away {c}. "
                f"How many {items} does {name} have now?")
    if kind == 1:
        return (f"At the {rng.choice(SHOPS)}, one {item} costs ${price:.2f}. {name} buys {b} {items} and pays with a "
                f"${rng.choice([20, 50, 100])} bill. How much change does {name} get?")
    if kind == 2:
        return (f"{name} earns ${b + 8} per {unit} {rng.choice(JOBS)}. How much does {name} earn after {c} {units} "
                f"if {name} also spends ${rng.randint(5, 30)} on supplies?")
    if kind == 3:
        return (f"A train travels at {a + 30} km/h for {c} hours and then at {b * 10} km/h for {rng.randint(1, 5)} "
                f"hours. What is the total distance, and what is the average speed?")
    if kind == 4:
        x = rng.randint(-20, 20)
        m, k = rng.randint(2, 9), rng.randint(-30, 30)
        return f"Solve for x: {m}x {'+' if k >= 0 else '-'} {abs(k)} = {m * x + k}. Show each step."
    if kind == 5:
        ops = rng.choice(["+", "-", "*"])
        nums = [rng.randint(10, 999) for _ in range(rng.randint(2, 4))]
        return f"Compute {f' {ops} '.join(map(str, nums))}. Explain how you got the result."
    if kind == 6:
        pct = rng.choice([10, 15, 20, 25, 30, 40])
        return (f"A jacket costs ${a * 3 + 20}. It is on sale for {pct}% off, and then a {c}% tax is added. "
                f"What is the final price?")
    return (f"{name} reads {b} pages a day. The book has {a * 10} pages. {other} reads {b + c} pages a day. "
            f"How many days earlier does {other} finish the book?")


CODE_LANGS = ["Python", "Python", "Python", "JavaScript", "TypeScript", "Rust", "Go", "C++", "Java", "Bash"]
CODE_TASKS = [
    ("reverse_words", "reverses the order of words in a sentence"),
    ("is_palindrome", "checks whether a string is a palindrome, ignoring case and punctuation"),
    ("fizzbuzz", "returns the FizzBuzz sequence up to n"),
    ("merge_sorted", "merges two sorted lists into one sorted list"),
    ("count_vowels", "counts the vowels in a string"),
    ("flatten", "flattens an arbitrarily nested list"),
    ("binary_search", "performs binary search on a sorted array and returns the index or -1"),
    ("word_frequencies", "returns the k most frequent words in a text"),
    ("parse_csv_line", "parses one CSV line, handling quoted fields"),
    ("roman_to_int", "converts a Roman numeral to an integer"),
    ("int_to_roman", "converts an integer to a Roman numeral"),
    ("gcd", "computes the greatest common divisor of two integers"),
    ("primes_below", "returns all primes below n using a sieve"),
    ("chunk", "splits a list into chunks of size k"),
    ("dedupe_keep_order", "removes duplicates from a list while keeping the first occurrence order"),
    ("matrix_transpose", "transposes a matrix given as a list of rows"),
    ("validate_email", "checks whether a string looks like a valid email address"),
    ("lru_cache", "implements a least-recently-used cache with get and put"),
    ("levenshtein", "computes the edit distance between two strings"),
    ("camel_to_snake", "converts camelCase identifiers to snake_case"),
    ("running_mean", "returns the running mean of a list of numbers"),
    ("balanced_brackets", "checks whether brackets in a string are balanced"),
    ("group_by_key", "groups a list of records by a given key"),
    ("top_k_largest", "returns the k largest numbers using a heap"),
]
CODE_EXTRAS = ["", " Include a docstring.", " Add a few unit tests.", " Explain the time complexity.",
               " Handle invalid input by raising an error.", " Keep it under 20 lines.", " Use type hints."]


def _code(rng: random.Random) -> str:
    lang = rng.choice(CODE_LANGS)
    name, what = rng.choice(CODE_TASKS)
    kind = rng.randrange(4)
    if kind == 0:
        return f"Write a {lang} function `{name}` that {what}.{rng.choice(CODE_EXTRAS)}"
    if kind == 1:
        return f"In {lang}, how would I write code that {what}? Show an example.{rng.choice(CODE_EXTRAS)}"
    if kind == 2:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        snippet = rng.choice([
            f"def add(a, b):\n    return a - b\n\nprint(add({a}, {b}))",
            f"for i in range({a}):\n    print(i\n",
            f"nums = [{a}, {b}, {a + b}]\ntotal = 0\nfor n in nums:\n    total =+ n\nprint(total)",
            f"def fact(n):\n    if n == 0:\n        return 0\n    return n * fact(n - 1)\n\nprint(fact({a}))",
        ])
        return f"Find and fix the bug in this Python code:\n\n```python\n{snippet}\n```"
    return f"Explain what this {lang} task involves and write a solution: a function that {what}."


TOPICS = ["renewable energy", "the history of tea", "urban gardening", "sleep hygiene", "volcanoes",
          "the printing press", "remote work", "honeybees", "ocean tides", "chess openings", "bread baking",
          "public libraries", "electric bicycles", "the water cycle", "board games", "time zones"]
ADJ = ["quick", "quiet", "bright", "careful", "heavy", "gentle", "busy", "small", "ancient", "modern"]
NOUNS = ["river", "teacher", "robot", "garden", "city", "engineer", "kitten", "library", "market", "storm"]
VERBS = ["crossed", "visited", "repaired", "painted", "followed", "described", "built", "found", "watched"]
FIELDS = ["name", "age", "city", "email", "role", "score"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Quito", "Oslo", "Perth", "Austin", "Hanoi", "Lyon", "Tunis"]


def _sentence(rng: random.Random) -> str:
    return (f"The {rng.choice(ADJ)} {rng.choice(NOUNS)} {rng.choice(VERBS)} the {rng.choice(ADJ)} "
            f"{rng.choice(NOUNS)} near the {rng.choice(NOUNS)}.")


def _format(rng: random.Random) -> str:
    kind = rng.randrange(8)
    if kind == 0:
        words = rng.sample(NOUNS + ADJ + CITIES, rng.randint(5, 9))
        return "Sort these words alphabetically and return them as a numbered list: " + ", ".join(words)
    if kind == 1:
        people = [(rng.choice(NAMES), rng.randint(18, 70), rng.choice(CITIES)) for _ in range(rng.randint(2, 4))]
        rows = "; ".join(f"{n}, {a}, {c}" for n, a, c in people)
        return f"Convert this data into a JSON list of objects with keys name, age and city: {rows}"
    if kind == 2:
        return f"Rewrite the following sentence in the passive voice: {_sentence(rng)}"
    if kind == 3:
        return f"Rewrite this in a more formal tone: {_sentence(rng)} {_sentence(rng)}"
    if kind == 4:
        cols = rng.sample(FIELDS, 3)
        return f"Make a markdown table with columns {', '.join(cols)} and {rng.randint(2, 5)} example rows."
    if kind == 5:
        return f"List {rng.randint(3, 7)} key facts about {rng.choice(TOPICS)} as bullet points."
    if kind == 6:
        return f"Summarize in one sentence: {_sentence(rng)} {_sentence(rng)} {_sentence(rng)}"
    return f"Write a short {rng.choice(['haiku', 'limerick', 'paragraph', 'tweet'])} about {rng.choice(TOPICS)}."


# Open-ended chat families: the kinds of request a chat drafter meets that the shared corpora (T0 tasks, GSM8K,
# self-instruct seeds) barely hold. Written here from word lists, not taken from any evaluation set; named apart
# from MT-bench's categories (writing, roleplay, ...) so per-category reports never pool the two.
FORMS = ["blog post", "short story", "poem", "persuasive essay", "email", "speech", "product description",
         "cover letter", "restaurant review", "diary entry", "newsletter", "podcast intro", "letter to the editor",
         "motivational message", "travel guide", "fable", "social media post", "opening paragraph of a novel"]
SUBJECTS = TOPICS + ["a first day at a new job", "a forgotten lighthouse", "a town without cars", "learning the violin",
                     "a rainy weekend in the mountains", "a neighborhood bakery", "moving to a new country",
                     "a lost dog finding its way home", "a robot learning to paint", "a community garden",
                     "saving money as a student", "an old friendship", "a winter market", "climbing a volcano",
                     "a small island festival", "a library that never closes", "starting a podcast", "desert stars"]
AUDIENCES = ["teenagers", "busy parents", "retirees", "first-time travelers", "software engineers",
             "small business owners", "children", "university students", "a hiring manager",
             "a local newspaper's readers", "a close friend"]
TONES = ["humorous", "heartfelt", "formal", "upbeat", "suspenseful", "calm", "enthusiastic", "nostalgic", "concise"]
PERSONAS = ["a ship's captain in the 1800s", "a detective solving a puzzling case", "a kind family doctor",
            "a medieval blacksmith", "a travel guide in Kyoto", "an astronaut on the space station", "a chess coach",
            "a famous chef", "a personal fitness trainer", "a librarian who loves mysteries", "a startup founder",
            "a wise old wizard", "a museum curator", "a park ranger", "a career counselor", "a stand-up comedian",
            "a history professor", "a pirate looking for treasure", "a gardener", "a customer support agent"]
ASKS = ["How do you start a typical day?", "What advice would you give to a beginner?",
        "Describe the hardest challenge you have faced.", "What is the one tool you could not work without?",
        "A visitor asks you for a recommendation. What do you say?", "Tell me about a memorable mistake.",
        "How would you explain your work to a child?", "What do people misunderstand about your job?",
        "Someone is nervous about meeting you. Greet them.", "What would you change about your world?"]
CONCEPTS = ["photosynthesis", "inflation", "the greenhouse effect", "supply and demand", "plate tectonics",
            "natural selection", "compound interest", "the scientific method", "black holes", "vaccines",
            "the Renaissance", "democracy", "machine learning", "the water cycle", "entropy", "the immune system",
            "the Industrial Revolution", "opportunity cost", "DNA replication", "the placebo effect", "cloud computing",
            "the Silk Road", "climate and weather", "nuclear fusion", "cognitive biases", "the printing press",
            "antibiotic resistance", "the stock market", "plate armor", "the theory of relativity", "urbanization",
            "game theory", "the French Revolution", "renewable energy storage", "the nitrogen cycle", "encryption"]
AREAS = ["everyday life", "medicine", "business", "history", "sports", "cooking", "education", "farming", "travel",
         "engineering", "politics", "the arts"]


def _compose(rng: random.Random) -> str:
    form, subject = rng.choice(FORMS), rng.choice(SUBJECTS)
    kind = rng.randrange(5)
    if kind == 0:
        return f"Write a {rng.choice(TONES)} {form} about {subject}."
    if kind == 1:
        words = rng.choice([100, 150, 200, 300])
        return f"Write a {form} about {subject} for {rng.choice(AUDIENCES)}. Keep it under {words} words."
    if kind == 2:
        return f"Compose a {form} about {subject} that starts with the sentence: {_sentence(rng)}"
    if kind == 3:
        return f"Draft a {rng.choice(TONES)} {form} for {rng.choice(AUDIENCES)} on {subject}, then give it a title."
    return f"Give me three ideas for a {form} about {subject}, then write the first paragraph of the best one."


def _persona(rng: random.Random) -> str:
    persona, ask = rng.choice(PERSONAS), rng.choice(ASKS)
    opener = rng.choice(["Pretend you are", "Act as", "Imagine you are", "You are", "Play the role of"])
    if rng.random() < 0.3:
        who, about = rng.choice(NOUNS), rng.choice(SUBJECTS)
        return f"{opener} {persona}. Stay in character. A {who} asks you about {about}. Reply."
    return f"{opener} {persona}. {ask}"


def _explain(rng: random.Random) -> str:
    concept, area = rng.choice(CONCEPTS), rng.choice(AREAS)
    kind = rng.randrange(5)
    if kind == 0:
        return f"Explain {concept} to {rng.choice(AUDIENCES)}."
    if kind == 1:
        return f"What is {concept}, and why does it matter? Give an example from {area}."
    if kind == 2:
        return f"How has our understanding of {concept} changed over time? Mention its role in {area}."
    if kind == 3:
        return f"Give {rng.randint(3, 6)} key points everyone should know about {concept}."
    return f"Describe {concept} in simple terms, then name one common misconception about it in {area}."

FAMILIES = {"math": _math, "code": _code, "format": _format, "compose": _compose, "persona": _persona,
            "explain": _explain}


def synthetic_prompts(n: int, seed: int = 0, families: list[str] | None = None,
                      weights: dict[str, float] | None = None) -> list[dict]:
    """n distinct prompt records `{"id","source","category","messages"}`; category = family name.

    Families are drawn by `weights` (default uniform). Ids are content hashes, so the same text always gets the
    same id (and therefore the same held-out assignment) whatever seed produced it."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    families = list(families or FAMILIES)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown synthetic families {unknown}; known: {sorted(FAMILIES)}")
    w = [float((weights or {}).get(f, 1.0)) for f in families]
    if any(x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"family weights must be >= 0 with a positive sum, got {dict(zip(families, w))}")
    rng = random.Random(seed)
    out, seen, attempts = [], set(), 0
    while len(out) < n:  # n distinct prompts; templates repeat, so skip exact repeats
        attempts += 1
        if attempts > 20 * n + 100:
            raise ValueError(f"could not draw {n} distinct prompts from families {families}")
        fam = rng.choices(families, weights=w)[0]
        text = FAMILIES[fam](rng)
        if text in seen:
            continue
        seen.add(text)
        out.append({"id": f"synthetic/{fam}/{hashlib.sha256(text.encode()).hexdigest()[:16]}",
                    "source": f"synthetic_{fam}", "category": fam,
                    "messages": [{"role": "user", "content": text}]})
    return out
