"""Chat requests for teaching a draft of a chat target: twelve kinds written for the project
(templates x topics x details, drawn with a seed), multi-turn chats, coding requests from
specengine.devtools.corpus, and the filter for requests the target writes itself. None may be a
benchmark prompt (bench/bench_categories.py's CATEGORIES); the held-out split is by request."""
from __future__ import annotations

import functools
import hashlib
import random
import re
import sys
from pathlib import Path

from specengine.devtools.corpus import code_prompts

ROOT = Path(__file__).resolve().parent.parent

TOPICS = [
    "volcanoes", "honey bees", "the Roman Empire", "black holes", "coffee", "electric cars", "the water cycle",
    "jazz music", "chess", "photosynthesis", "the printing press", "sleep", "recycling", "the Moon landing",
    "rainforests", "vaccines", "bicycles", "the stock market", "octopuses", "solar panels", "the Silk Road",
    "earthquakes", "chocolate", "the human heart", "libraries", "video games", "climate change", "bridges",
    "the Olympic Games", "mushrooms", "time zones", "the internet", "dinosaurs", "yoga", "glaciers",
    "the French Revolution", "bread baking", "tides", "robots", "public transport", "whales", "the piano",
    "deserts", "antibiotics", "gardening", "airplanes", "the Renaissance", "friendship", "budgeting",
    "marathon running", "tea", "the immune system", "castles", "satellites", "origami", "coral reefs",
]
PEOPLE = ["Maya", "Tom", "Aisha", "Lukas", "Priya", "Diego", "Hana", "Omar", "Sofia", "Ben", "Yuki", "Nadia"]
PLACES = ["a small fishing village", "a busy train station", "a space station", "an old bookshop", "a mountain cabin",
          "a night market", "a school science fair", "a desert oasis", "a rainy city", "a farm in autumn"]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese"]
SENTENCES = [
    "The museum is closed on Mondays.", "Could you tell me where the nearest pharmacy is?",
    "We are planning a trip to the mountains next summer.", "My brother works as a nurse at the city hospital.",
    "Please remember to water the plants while I am away.", "The train to the airport leaves every twenty minutes.",
    "I would like a table for two by the window.", "It has been raining all week, so the river is very high.",
    "She learned to play the violin when she was seven.", "Our meeting has been moved to Thursday afternoon.",
    "The bakery on the corner sells fresh bread every morning.", "He forgot his umbrella at the restaurant.",
]
PASSAGES = [
    "The Amazon rainforest covers about 5.5 million square kilometres across nine countries, most of it in "
    "Brazil. It holds around 10 percent of the species known on Earth. Deforestation, mainly for cattle "
    "ranching and soy farming, removed about 17 percent of its area in the last fifty years.",
    "Marie Curie was born in Warsaw in 1867 and moved to Paris in 1891 to study physics and mathematics. She "
    "shared the 1903 Nobel Prize in Physics with Pierre Curie and Henri Becquerel, and won the 1911 Nobel "
    "Prize in Chemistry for discovering polonium and radium.",
    "The city council approved a budget of 42 million dollars for the new library, which will open in March "
    "2027. The building will have three floors, a children's wing, 60 public computers and a rooftop garden. "
    "Construction starts in June and is expected to take 20 months.",
    "Honey bees communicate the location of flowers with a waggle dance. The angle of the dance relative to "
    "the vertical shows the direction of the food relative to the sun, and the length of the waggle run "
    "tells the distance. A colony can hold 20,000 to 80,000 bees.",
    "Our quarterly report shows revenue of 3.2 million euros, up 8 percent from last quarter. Costs rose 5 "
    "percent, mostly from shipping. The team hired four engineers and opened an office in Lisbon. The main "
    "risk for next quarter is a delay in the new product launch.",
    "The Great Wall of China was built over many centuries, starting in the 7th century BC. The best known "
    "parts were built during the Ming dynasty (1368-1644). Its total length, including all branches, is "
    "about 21,000 kilometres.",
    "Patient notes: Anna Berg, 34, reports headaches for two weeks, worse in the evening. No fever. Blood "
    "pressure 118/76. She works long hours at a computer and drinks four cups of coffee a day. Advised "
    "screen breaks, more water and a follow-up visit in ten days.",
    "The recipe needs 250 grams of flour, 2 eggs, 300 millilitres of milk, a pinch of salt and 1 tablespoon "
    "of melted butter. Whisk everything into a smooth batter, rest it for 30 minutes, then cook thin "
    "pancakes in a hot pan for about a minute on each side.",
    "Mount Everest, at 8,849 metres, is the highest mountain above sea level. It was first climbed in 1953 "
    "by Edmund Hillary and Tenzing Norgay. Today several hundred climbers reach the summit each year, "
    "mostly in May when the winds are calmer.",
    "The company's new phone has a 6.1-inch screen, 128 GB of storage, a battery that lasts about 20 hours "
    "and two rear cameras. It costs 699 dollars and comes in black, white and green. Pre-orders open on "
    "September 12.",
]

THINGS = ["marble", "pencil", "ticket", "coin", "card", "shell"]
CITIES = ["Lyon", "Osaka", "Denver", "Porto", "Nairobi", "Krakow", "Austin", "Busan", "Bergen", "Cordoba"]
SHOPS = ["bakery", "bike repair shop", "bookshop", "cafe", "pottery studio", "flower shop", "music school"]
GENERATED_PASSAGES = [
    "{person} opened a {shop} in {city} in {year} with {a} employees. By {year2} it had {c} employees and "
    "served about {big} customers a week. The biggest challenge, {person} says, was finding a building with "
    "enough space; the next plan is a second location near the university.",
    "The {city} marathon on {day} drew {big} runners from {a} countries. {person} won the women's race in 2 "
    "hours {c} minutes, and {person2} won the men's race. Organisers said the weather was cool and dry, and "
    "volunteers handed out {big2} bottles of water.",
    "Meeting notes ({day}): {person} presented the budget for the {topic} project, {big} thousand dollars in "
    "total. {person2} asked for {a} more weeks for testing. The team agreed to meet again on the {c}th and "
    "to send the final report to {person3} before then.",
    "A survey of {big} students in {city} found that {c} percent read for fun at least once a week, while "
    "{a} percent never do. Students who read often slept longer on average. The researchers, led by "
    "{person}, plan to repeat the survey in {year2}.",
    "Product review: the {topic}-themed board game costs {c} dollars and takes about {a}0 minutes to play. "
    "{person} liked the colourful pieces but found the rules confusing at first. It suits 2 to {b} players "
    "aged 10 and up.",
]
TEMPLATES: dict[str, list[str]] = {
    "writing": [
        "Write a short story about {person} in {place}.", "Write a poem about {topic}.",
        "Write a blog post introduction about {topic}.", "Write a haiku about {topic}.",
        "Write a product description for a book about {topic}.", "Write a short speech for a school event about {topic}.",
        "Write a thank-you note to {person} for helping me learn about {topic}.",
        "Write a diary entry from {person}, who spent the day at {place}.",
        "Write a limerick about {topic}.", "Write an email to my team announcing a workshop on {topic}.",
    ],
    "roleplay": [
        "Pretend you are a tour guide at {place}. Welcome our group.",
        "You are a friendly expert on {topic}. I am a curious child. Tell me something amazing.",
        "Act as a job interviewer for a role related to {topic} and ask me your first question.",
        "Imagine you are {person}, a shopkeeper at {place}. A customer walks in. What do you say?",
        "Play the role of a museum guide explaining an exhibit about {topic}.",
        "You are a coach. Give me a pep talk before my first competition in {topic}.",
        "Pretend to be a detective arriving at {place}. Describe what you notice first.",
    ],
    "reasoning": [
        "{person} is older than {person2}, and {person2} is older than {person3}. Who is the youngest? Explain.",
        "If every {thing} in the box is red and {person} takes one {thing} from the box, what colour is it? Explain.",
        "A farmer has {a} sheep and all but {b} run away. How many are left? Think step by step.",
        "{person} has {a} apples, gives {b} to {person2} and then buys {c} more. How many does {person} have?",
        "What are the pros and cons of learning about {topic} at school?",
        "Which is heavier, a kilogram of feathers or a kilogram of steel? Explain.",
        "If it takes {a} machines {a} minutes to make {a} widgets, how long would {c} machines take to make {c} widgets?",
        "Why might a city invest in {topic}? Give three reasons.",
    ],
    "math": [
        "What is {a} times {b}?", "Solve for x: {a}x + {b} = {c}.", "What is {a} percent of {big}?",
        "A train travels {big} kilometres in {a} hours. What is its average speed?",
        "Simplify the fraction {b}/{c}.", "What is the area of a rectangle {a} cm wide and {b} cm long?",
        "Is {big} a prime number? Explain.", "Compute {big} + {big2} - {c}.",
        "A shirt costs {big} dollars and is discounted by {a} percent. What is the new price?",
        "What is the square root of {sq}?", "Convert {a} hours and {b} minutes into minutes.",
    ],
    "coding": [
        "Write a Python function that checks whether a string is a palindrome.",
        "Write a Python function that returns the {a} largest numbers in a list.",
        "How do I read a CSV file in Python and print the first {a} rows?",
        "Explain the difference between a list and a tuple in Python.",
        "Write a SQL query that counts the customers in each city.",
        "Write a JavaScript function that reverses the words in a sentence.",
        "What does the Python keyword 'yield' do? Give an example.",
        "Write a Python class for a bank account with deposit and withdraw methods.",
        "How can I remove duplicates from a list in Python while keeping the order?",
        "Write a bash command that counts the lines in every .txt file in a folder.",
    ],
    "extraction": [
        "Extract all the numbers from this text and say what each one refers to:\n\n{passage}",
        "List the names of people and places mentioned in this text:\n\n{passage}",
        "From the text below, extract the dates and the events they belong to.\n\n{passage}",
        "Return the key facts from this text as a JSON object:\n\n{passage}",
        "What are the three most important facts in this text? Answer as a bullet list.\n\n{passage}",
    ],
    "stem": [
        "Explain how {topic} works in simple terms.", "What is the science behind {topic}?",
        "Explain the difference between speed and velocity.", "Why do leaves change colour in autumn?",
        "How does a vaccine train the immune system?", "What causes the seasons on Earth?",
        "Describe the main parts of a cell and what they do.", "How do engineers make {topic} safer?",
        "What is the role of {topic} in the environment?", "Explain Newton's third law with an example.",
    ],
    "humanities": [
        "What was the historical importance of {topic}?", "Summarize the main causes of the French Revolution.",
        "How did {topic} change everyday life?", "What can we learn from the history of {topic}?",
        "Compare the art of the Renaissance with the art of the Middle Ages.",
        "Why do people find philosophy useful? Give examples.", "What role did {topic} play in culture?",
        "Describe the life of a child in ancient Rome.",
    ],
    "translation": [
        "Translate into {language}: '{sentence}'", "How do you say '{sentence}' in {language}?",
        "Translate this sentence into {language} and explain any difficult words: {sentence}",
    ],
    "summarization": [
        "Summarize this in one sentence:\n\n{passage}", "Give a short summary of the following text:\n\n{passage}",
        "Summarize the text below for a ten-year-old.\n\n{passage}",
        "Write a headline and a two-sentence summary for this text:\n\n{passage}",
    ],
    "qa": [
        "What is {topic}?", "Why is {topic} important?", "How can I learn more about {topic}?",
        "What are some interesting facts about {topic}?", "What is a common misconception about {topic}?",
        "How do I get started with {topic}?", "Who invented the telephone?", "How many continents are there?",
        "What should I pack for a weekend trip to {place}?", "How can I sleep better?",
    ],
    "rag": [
        "Answer the question using only the text below.\n\nText: {passage}\n\nQuestion: {question}",
        "Read the document and answer: {question}\n\nDocument:\n{passage}",
        "Context:\n{passage}\n\nBased on the context, {question_lower}",
    ],
}
QUESTIONS = ["What is the main point of the text?", "Which numbers appear in the text, and what do they measure?",
             "Who or what is the text about?", "What happens next, according to the text?",
             "What is one risk or problem the text mentions?"]
FOLLOW_UPS = ["Can you make it shorter?", "Can you explain that in simpler words?", "Give me one more example.",
              "Thanks! Can you turn that into a bullet list?", "Why is that?", "Can you add a title?",
              "What would be a good next step?", "Now write it in a more formal tone."]
KINDS = tuple(TEMPLATES)


def benchmark_prompts() -> set[str]:
    """The benchmark's requests (bench/bench_categories.py): never trained on."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from bench_categories import CATEGORIES
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return {text for texts in CATEGORIES.values() for text in texts}


def distinct_non_benchmark(requests: list[dict]) -> list[dict]:
    """The requests without duplicates and without any whose turn is a benchmark prompt."""
    bench = {normalized(t) for t in benchmark_prompts()}
    kept, seen = [], set()
    for r in requests:
        key = normalized(" ".join(r["turns"]))
        if key not in seen and not any(normalized(turn) in bench for turn in r["turns"]):
            seen.add(key)
            kept.append(r)
    return kept


def _fill(template: str, rng: random.Random) -> str:
    people = rng.sample(PEOPLE, 3)
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    question = rng.choice(QUESTIONS)
    year = rng.randint(1990, 2020)
    passage = rng.choice(PASSAGES) if rng.random() < 0.4 else rng.choice(GENERATED_PASSAGES).format(
        person=people[0], person2=people[1], person3=people[2], shop=rng.choice(SHOPS), city=rng.choice(CITIES),
        year=year, year2=year + rng.randint(2, 6), a=a, b=b, c=rng.randint(13, 60), big=rng.randint(300, 9000),
        big2=rng.randint(1000, 20000), topic=rng.choice(TOPICS),
        day=rng.choice(["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]))
    slots = dict(topic=rng.choice(TOPICS), thing=rng.choice(THINGS), person=people[0], person2=people[1], person3=people[2],
                 place=rng.choice(PLACES), language=rng.choice(LANGUAGES), sentence=rng.choice(SENTENCES),
                 passage=passage, question=question, question_lower=question[0].lower() + question[1:],
                 a=a, b=b, c=rng.randint(a + 1, 60), big=rng.randint(100, 999), big2=rng.randint(100, 999),
                 sq=rng.choice([16, 25, 36, 49, 64, 81, 100, 121, 144, 169, 196, 225]))
    return template.format(**slots)


@functools.lru_cache(maxsize=4)
def code_requests(seed: int) -> tuple[str, ...]:
    """The chat requests of devtools.corpus (train side of its split) drawn with this seed (parsing
    the standard library takes a while: kept)."""
    return tuple(p["chat"][0]["content"] for p in code_prompts(held_out=False, seed=seed) if "chat" in p)


def project_requests(count: int, seed: int, multi_turn_share: float = 0.15, code_share: float = 0.5) -> list[dict]:
    """`count` distinct requests {"kind", "turns": [user messages]}: the twelve kinds in turn, a
    share with a follow-up turn (the target answers the first turn before the second is asked),
    half the coding requests about the standard library's functions (devtools.corpus). The kinds
    take turns by attempt, so a kind whose templates run out of new requests gives way to the others."""
    rng = random.Random(seed)
    code = list(code_requests(seed))
    rng.shuffle(code)
    out, seen, tries = [], set(), 0
    while len(out) < count and tries < 50 * count:
        kind = KINDS[tries % len(KINDS)]
        tries += 1
        if kind == "coding" and code and rng.random() < code_share:
            text = code.pop()
        else:
            text = _fill(rng.choice(TEMPLATES[kind]), rng)
        if text in seen:
            continue
        seen.add(text)
        turns = [text] + ([rng.choice(FOLLOW_UPS)] if rng.random() < multi_turn_share else [])
        out.append(dict(kind=kind, turns=turns, source="project"))
    return out


def sane_request(text: str) -> bool:
    """A request the target wrote that is worth answering: a few words to a paragraph, printable,
    no chat markup, not a loop of one phrase."""
    words = text.split()
    if not 3 <= len(words) <= 120 or "<|" in text or "|>" in text:
        return False
    if sum(ch.isprintable() or ch in "\n\t" for ch in text) < 0.98 * len(text):
        return False
    if len(set(w.lower() for w in words)) < 0.5 * len(words):
        return False
    return bool(re.search(r"[A-Za-z]{3}", text))


def normalized(text: str) -> str:
    return " ".join(text.lower().split())


def is_held_out(text: str, seed: int, share: int) -> bool:
    """The split by request: 1 request in `share` (by a hash of its first turn and the seed)."""
    return hashlib.sha256(f"{seed}:{normalized(text)}".encode()).digest()[0] % share == 0
