"""Make the verifiable-instruction prompt sets (issue 43): `bench`, `train` and `eval`.

    .venv/bin/python scripts/make_instruction_prompts.py [--seed 0] [--out jobs/instructions]

The defaults rewrite the committed files byte for byte (tests/test_instruction_prompts.py
checks it): jobs/instructions/{bench,train,eval}.jsonl and the README.md that summarises them.

How a set is made, exactly:

1. Base tasks. TEMPLATES are 19 open task types of our own ("Write a short poem about
   {topic}.", "Give advice to someone who wants to {goal}.", ...) and YES_NO_TEMPLATES 3 yes/no
   questions on a goal; each has one slot: a topic, a thing, a goal or a place. FILLERS holds
   the fillers for each slot (281 in all, no string in two pools, and chosen by hand so that
   no subject stands in two: not "yoga" beside "a yoga mat"). Each pool, sorted and then
   shuffled by the seeded generator, is cut into three disjoint parts in the proportion of the
   splits' sizes (64 : 320 : 128); a split's base tasks use only its own part, so no topic,
   thing, goal or place is shared between splits and `eval` is held out from `train` by
   subject, not only by row. Within a split no base task repeats.
2. Instructions. Each prompt gets n instructions, n uniform in 1..3. They are drawn one at a
   time, uniformly over the usable ids that are not already chosen and do not conflict with
   one already chosen; when none is left, the prompt keeps fewer (detectable_format:
   constrained_response conflicts with every id, so it always stands alone).
   - Usable ids: every id of if-verifiable's IFEval registry (INSTRUCTION_DICT) except
     length_constraints:number_sentences and change_case:capital_word_frequency. Their
     checkers call nltk's punkt / punkt_tab tokenizer data, which is not installed and cannot
     be downloaded on an offline machine, so a prompt carrying them could not be scored.
   - Conflicts: INSTRUCTION_CONFLICTS read both ways (A lists B or B lists A), plus two of
     ours that no answer could meet: change_case:english_lowercase with
     detectable_format:multiple_sections (both of IFEval's section markers, "Section" and
     "SECTION", hold a capital letter), and combination:repeat_prompt with
     punctuation:no_comma (the request to repeat word for word holds no_comma's own sentence,
     "In your entire response, refrain from the use of any commas.").
3. The base task. A prompt with detectable_format:constrained_response ("Answer with one of
   the following options: My answer is yes/no/maybe.") takes one of the yes/no templates,
   uniformly; every other prompt takes a slot uniformly, then one of its open templates
   uniformly. The filler is drawn uniformly from the split's part of the slot's pool; the
   template and filler are drawn again until the base task is new to the split.
4. Arguments. Every argument a checker's build_description takes is passed explicitly (a
   checker draws a missing one at random), named as the checker names it. The answers come
   from SmolLM2-135M-Instruct in at most 256 new tokens (about 180 English words), so the
   ranges are ones such an answer can meet:
   - length_constraints:number_words: "at least" 20..120 or "less than" 40..150 (steps of 10);
   - length_constraints:number_paragraphs 2..3; nth_paragraph_first_word: 2..3 paragraphs,
     the n-th of them (uniform) starting with a word from FIRST_WORDS;
   - detectable_format:multiple_sections 2..3 ("SECTION" when the answer must be in
     capitals, else Section or SECTION); number_bullet_lists 2..4; number_highlighted_sections
     1..3; detectable_content:number_placeholders 1..3; postscript P.S. or P.P.S;
   - keywords:existence 1..2 words from KEYWORDS; keywords:forbidden_words 1..3 words from
     COMMON_WORDS (words a short answer tends to use, so the ban bites); keywords:frequency
     1..3 times, "at least" a KEYWORDS word or "less than" a COMMON_WORDS word;
   - keywords:letter_frequency: "at least" 3..8 of a frequent letter, or "less than" 2..5 of a
     rare one (j, q, x, z) that the base task does not contain;
   - language:response_language: de, es, fr, it or pt (widely written languages, more within
     an English-first 135M model's reach than IFEval's whole list: Kannada, Punjabi, ...);
   - startend:end_checker: one of IFEval's two end phrases.
   A word drawn for a prompt never occurs in its base task nor in another word drawn for it
   (the frequency and existence checkers match substrings), so a prompt never asks for and
   bans the same word. The word pools share no substrings, hold no rare letter and no word of
   the end phrases (checked by the test).
5. Prompt text: the base task, then each instruction's description in IFEval's own wording
   (build_description with the row's kwargs), joined by a space after a sentence's end and by
   a newline after a description that ends otherwise (a bullet or section example). As in
   IFEval, combination:repeat_prompt's sentence comes last, after a newline, and its
   prompt_to_repeat is the whole request before it (the base task with the other
   instructions); its id is listed last.
6. Rows are IFEval's own format plus an id: {"id": "<split>-<n>", "key": n, "prompt": ...,
   "instruction_id_list": [...], "kwargs": [{...}, ...]} (kwargs {} for a checker without
   arguments), one JSON object a line.

Deterministic for a seed: one random.Random(seed) draws everything, in a fixed order (the
pools' cut, then bench, train, eval); every iteration is over sorted or listed items.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from if_verifiable.ifeval.instructions_registry import INSTRUCTION_CONFLICTS, INSTRUCTION_DICT

DEFAULT_SEED = 0
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "jobs" / "instructions"
SPLITS: dict[str, int] = {"bench": 64, "train": 320, "eval": 128}

# checkers that need nltk's punkt data (not installed, no network): see the docstring
EXCLUDED_IDS = ("change_case:capital_word_frequency", "length_constraints:number_sentences")
USABLE_IDS = tuple(sorted(i for i in INSTRUCTION_DICT if i not in EXCLUDED_IDS))
EXTRA_CONFLICTS = (("change_case:english_lowercase", "detectable_format:multiple_sections"),
                   ("combination:repeat_prompt", "punctuation:no_comma"))
CONSTRAINED = "detectable_format:constrained_response"
REPEAT = "combination:repeat_prompt"

TEMPLATES: dict[str, tuple[str, ...]] = {
    "topic": (
        "Write a short poem about {}.",
        "Explain {} to a ten-year-old.",
        "Write a short blog post about {}.",
        "List some interesting facts about {}.",
        "Write a short story that involves {}.",
        "Write a riddle about {}.",
        "Write a short quiz for students about {}.",
    ),
    "thing": (
        "Write a product description for {}.",
        "Write a short advertisement for {}.",
        "Write a customer review of {}.",
        "Write a limerick about {}.",
    ),
    "goal": (
        "Give advice to someone who wants to {}.",
        "Write a step-by-step plan for someone who wants to {}.",
        "Write a motivational message for a friend who wants to {}.",
        "Write an email to a mentor asking for help to {}.",
    ),
    "place": (
        "Describe a day trip to {}.",
        "Write a travel guide entry for {}.",
        "Write a postcard message sent from {}.",
        "Write a short story set in {}.",
    ),
}
# only for prompts with detectable_format:constrained_response (a yes/no/maybe answer)
YES_NO_TEMPLATES: tuple[str, ...] = (
    "Is it a good idea to {} this year?",
    "Should a busy person try to {}?",
    "Can a beginner {} within six months?",
)
YES_NO_SLOT = "goal"

FILLERS: dict[str, tuple[str, ...]] = {
    "topic": (
        "photosynthesis", "the water cycle", "volcanoes", "honeybees", "black holes",
        "the human heart", "rainbows", "compound interest", "recycling", "the printing press",
        "ocean tides", "earthquakes", "static electricity", "magnets", "the immune system",
        "dinosaurs", "the Roman Empire", "coral reefs", "migrating birds", "the four seasons",
        "gravity", "the solar system", "clouds", "dreams", "friendship",
        "kindness to strangers", "jazz music", "the game of chess", "the early internet",
        "baking sourdough bread", "the history of coffee", "honey", "octopuses", "penguins",
        "elephants", "rain forests", "glaciers", "the alphabet", "old paper maps",
        "pendulum clocks", "the first airplanes", "lighthouses", "fireflies", "snowflakes",
        "the northern lights", "the moon's phases", "comets", "fossils", "wind turbines",
        "solar panels", "composting", "the ancient Olympics", "hieroglyphs", "the compass",
        "vaccines", "bacteria", "the human brain", "the sense of smell", "rainwater",
        "autumn leaves", "spider webs", "ants and their colonies", "whales", "sea turtles",
        "the periodic table", "prime numbers", "origami", "the violin", "street murals",
        "public libraries", "the postal service", "marbles", "pottery", "tai chi",
        "chocolate", "spices", "the potato", "rice farming", "the Silk Road",
        "handwriting", "Braille", "the Great Wall of China", "recess at school",
        "grandparents", "city parks", "bridges", "skyscrapers", "trains", "hot air balloons",
        "submarines", "the wheel", "video games", "radio", "the telephone", "photography",
        "silent films", "puppets", "kites", "sandcastles", "thunderstorms", "fog",
    ),
    "thing": (
        "a reusable water bottle", "a folding bicycle", "a smart doorbell",
        "noise-cancelling headphones", "a cast iron skillet", "a reading lamp with a timer",
        "a waterproof hiking backpack", "a wireless phone charger", "an electric kettle",
        "a weighted blanket", "a standing desk", "a pocket notebook", "a robot vacuum",
        "a set of wooden building blocks", "a sewing kit", "a neck pillow",
        "a mechanical keyboard", "a rain jacket for kids", "a pair of running shoes",
        "a french press", "a portable speaker", "a yoga mat", "a porch swing",
        "a deck of playing cards", "a digital photo frame", "a slow cooker",
        "a pair of reading glasses", "a pet collar that glows", "a bamboo toothbrush",
        "a lunch box that keeps food warm", "a handmade ceramic mug", "a telescope for beginners",
        "a set of colored pencils", "a fitness tracker", "a camping stove",
        "a beeswax food wrap", "a waffle iron", "an e-reader", "a wall calendar",
        "a sleeping bag", "a plant pot that waters itself", "a sun hat", "a label maker",
        "a cordless drill", "a scented candle", "a picnic basket", "a snow shovel",
        "a kids' scooter", "a pair of wool socks", "a tablet stand", "a jigsaw puzzle",
        "a fountain pen", "a hammock", "an umbrella that never flips", "a toolbox",
        "a baby monitor", "a garden hose", "a water filter pitcher", "a bike helmet",
        "a microwave popcorn maker", "a sketchbook", "a keychain flashlight",
        "an automatic pet feeder", "a bathroom scale", "a pair of leather gloves",
    ),
    "goal": (
        "learn to play the guitar", "run a first marathon", "start a vegetable garden",
        "save money for a house", "learn to cook healthy meals", "read more books",
        "get better sleep", "learn a new language", "start a small business",
        "change careers at forty", "become a better public speaker", "learn to swim",
        "write a novel", "reduce screen time", "make new friends in a new city",
        "adopt a dog", "learn to code", "get organized at home", "travel on a tight budget",
        "start journaling", "learn to draw", "pay off a credit card", "volunteer locally",
        "wake up earlier", "learn to bake pastries", "get fit without a gym",
        "prepare for a job interview", "learn calligraphy", "plan a surprise party",
        "move abroad", "learn to ride a unicycle", "keep houseplants alive", "cut down on sugar",
        "learn to meditate", "ask for a raise", "study for a big exam", "learn to knit",
        "start a podcast", "become a morning runner", "spend less on groceries",
        "learn to sing", "build a treehouse", "learn to sail", "grow tomatoes on a balcony",
        "become a teacher", "learn woodworking", "train for a triathlon",
        "declutter a closet", "go back to college", "learn to dance", "write poetry",
        "learn basic car repair", "become more patient", "learn to play the piano",
        "start a walking group", "learn first aid", "climb a mountain", "keep a tidy kitchen",
        "learn to juggle", "speak up in meetings", "raise chickens", "go on a solo road trip",
        "learn to paint with watercolors", "teach kids about money", "eat less fast food",
    ),
    "place": (
        "a small fishing village", "a street food alley", "a windswept sea cliff",
        "an alpine lake", "a desert oasis", "a rainy harbor town", "a snowy ski resort",
        "a quiet monastery", "a houseboat on a lake", "a national park in spring",
        "a city of canals", "a tiny island with one shop", "a vineyard in the hills",
        "an abandoned mining town", "a busy airport", "a lavender farm",
        "a medieval castle town", "a mangrove coast", "a cave with glowing worms",
        "a tea plantation", "a volcanic beach with black sand", "a prairie town",
        "a zoo at night", "a lakeside cabin", "a bustling bazaar", "a science museum",
        "a seaside amusement pier", "a botanical garden", "a windy hilltop",
        "a river delta", "an arctic research station", "a hot spring village",
        "a sunflower field", "a port city at dawn", "a cliffside chapel",
        "an old university town", "a redwood grove", "a salt flat", "a lagoon village",
        "a farmers' market", "a tulip festival", "a wildlife reserve", "a canyon trail",
        "a misty moor", "a rooftop terrace", "a town built on stilts", "a quiet fjord",
        "a cherry orchard", "a lantern festival", "a paddle steamer trip",
    ),
}

# Words the instructions' arguments draw from: no j, q, x or z (the rare letters a
# "less than" letter frequency bans), none a substring of another (the frequency and
# existence checkers match substrings), none in IFEval's end phrases.
KEYWORDS: tuple[str, ...] = (
    "bright", "simple", "future", "careful", "history", "morning", "garden", "balance",
    "energy", "habit", "patience", "island", "market", "ocean", "signal", "memory", "season",
    "window", "silver", "promise", "courage", "harbor", "winter", "planet", "rhythm",
    "pattern", "budget", "lesson", "victory", "mirror", "shadow", "thunder", "village",
    "candle", "orbit", "engine", "meadow", "pebble", "lantern", "compass", "forest",
    "secret", "wonder", "harvest", "spark", "anchor", "castle", "feather", "gentle",
    "steady", "curious", "ancient", "useful", "natural", "golden", "velvet", "tunnel",
)
COMMON_WORDS: tuple[str, ...] = (
    "very", "really", "important", "also", "because", "many", "good", "great", "people",
    "like", "best", "time", "first", "always", "should", "make", "about", "more", "most",
    "need", "different", "world", "life", "fun", "easy", "nice", "lots",
)
FIRST_WORDS: tuple[str, ...] = (
    "today", "imagine", "however", "finally", "overall", "remember", "meanwhile", "still",
    "once", "suddenly", "luckily", "perhaps",
)
ENDING_PHRASES: tuple[str, ...] = (  # IFEval's own two
    "Any other questions?", "Is there anything else I can help with?")
LANGUAGES: tuple[str, ...] = ("de", "es", "fr", "it", "pt")
FREQUENT_LETTERS = "acdehilmnorstu"
RARE_LETTERS = "jqxz"
RELATIONS = ("less than", "at least")


@dataclass(frozen=True)
class Drawn:
    """One prompt as drawn: its base task, the filler it was made from, and its row."""

    base_task: str
    slot: str
    filler: str
    row: dict


def conflicts(a: str, b: str) -> bool:
    """Whether two ids may not share a prompt: the registry's conflicts read both ways, ours."""
    return (a == b or b in INSTRUCTION_CONFLICTS.get(a, ()) or a in INSTRUCTION_CONFLICTS.get(b, ())
            or (a, b) in EXTRA_CONFLICTS or (b, a) in EXTRA_CONFLICTS)


def argument_names(instruction_id: str) -> list[str]:
    """The arguments the checker's build_description takes, in its own order."""
    checker = INSTRUCTION_DICT[instruction_id](instruction_id)
    return list(inspect.signature(checker.build_description).parameters)


def cut_pools(rng: random.Random) -> dict[str, dict[str, list[str]]]:
    """Each slot's fillers, shuffled, cut into disjoint parts sized as the splits are."""
    total = sum(SPLITS.values())
    parts: dict[str, dict[str, list[str]]] = {split: {} for split in SPLITS}
    for slot in sorted(FILLERS):
        pool = sorted(FILLERS[slot])
        rng.shuffle(pool)
        start = 0
        for i, (split, size) in enumerate(SPLITS.items()):
            stop = len(pool) if i == len(SPLITS) - 1 else start + round(len(pool) * size / total)
            parts[split][slot] = pool[start:stop]
            start = stop
    return parts


def draw_ids(rng: random.Random) -> list[str]:
    """1 to 3 ids, one at a time, uniform over those still allowed beside the ones chosen."""
    chosen: list[str] = []
    for _ in range(rng.randint(1, 3)):
        allowed = [i for i in USABLE_IDS if not any(conflicts(i, c) for c in chosen)]
        if not allowed:
            break
        chosen.append(rng.choice(allowed))
    if REPEAT in chosen:  # its sentence ends the prompt, as in IFEval
        chosen.remove(REPEAT)
        chosen.append(REPEAT)
    return chosen


def draw_base_task(rng: random.Random, ids: list[str], part: dict[str, list[str]],
                   used: set[str]) -> tuple[str, str, str]:
    """(base task, slot, filler): a template, then a filler of the split's part, new to it."""
    while True:
        if CONSTRAINED in ids:
            slot, template = YES_NO_SLOT, rng.choice(YES_NO_TEMPLATES)
        else:
            slot = rng.choice(sorted(TEMPLATES))
            template = rng.choice(TEMPLATES[slot])
        filler = rng.choice(part[slot])
        task = template.format(filler)
        if task not in used:
            return task, slot, filler


class WordDraw:
    """Words for one prompt's arguments: never in its base task, never overlapping another."""

    def __init__(self, rng: random.Random, base_task: str) -> None:
        self.rng, self.base, self.taken = rng, base_task.lower(), []

    def free(self, word: str) -> bool:
        return word not in self.base and not any(word in t or t in word for t in self.taken)

    def sample(self, pool: tuple[str, ...], k: int) -> list[str]:
        words = self.rng.sample([w for w in pool if self.free(w)], k)
        self.taken += words
        return words


def draw_kwargs(rng: random.Random, instruction_id: str, ids: list[str],
                words: WordDraw) -> dict:
    """The checker's every argument (none left to its own random draw), by its own names."""
    match instruction_id:
        case "keywords:existence":
            return {"keywords": sorted(words.sample(KEYWORDS, rng.randint(1, 2)))}
        case "keywords:forbidden_words":
            return {"forbidden_words": sorted(words.sample(COMMON_WORDS, rng.randint(1, 3)))}
        case "keywords:frequency":
            relation = rng.choice(RELATIONS)
            pool = KEYWORDS if relation == "at least" else COMMON_WORDS
            return {"keyword": words.sample(pool, 1)[0], "frequency": rng.randint(1, 3),
                    "relation": relation}
        case "keywords:letter_frequency":
            rare = [c for c in RARE_LETTERS if c not in words.base]
            if rare and rng.choice(RELATIONS) == "less than":
                return {"letter": rng.choice(rare), "let_frequency": rng.randint(2, 5),
                        "let_relation": "less than"}
            return {"letter": rng.choice(FREQUENT_LETTERS), "let_frequency": rng.randint(3, 8),
                    "let_relation": "at least"}
        case "language:response_language":
            return {"language": rng.choice(LANGUAGES)}
        case "length_constraints:number_words":
            relation = rng.choice(RELATIONS)
            low, high = (20, 120) if relation == "at least" else (40, 150)
            return {"num_words": rng.randrange(low, high + 1, 10), "relation": relation}
        case "length_constraints:number_paragraphs":
            return {"num_paragraphs": rng.randint(2, 3)}
        case "length_constraints:nth_paragraph_first_word":
            num = rng.randint(2, 3)
            return {"num_paragraphs": num, "nth_paragraph": rng.randint(1, num),
                    "first_word": words.sample(FIRST_WORDS, 1)[0]}
        case "detectable_content:number_placeholders":
            return {"num_placeholders": rng.randint(1, 3)}
        case "detectable_content:postscript":
            return {"postscript_marker": rng.choice(("P.S.", "P.P.S"))}
        case "detectable_format:number_bullet_lists":
            return {"num_bullets": rng.randint(2, 4)}
        case "detectable_format:number_highlighted_sections":
            return {"num_highlights": rng.randint(1, 3)}
        case "detectable_format:multiple_sections":
            capitals = "change_case:english_capital" in ids
            spliter = "SECTION" if capitals else rng.choice(("Section", "SECTION"))
            return {"section_spliter": spliter, "num_sections": rng.randint(2, 3)}
        case "startend:end_checker":
            return {"end_phrase": rng.choice(ENDING_PHRASES)}
    if argument_names(instruction_id):  # a checker with arguments this function forgot
        raise ValueError(f"{instruction_id}: no argument draw written for it")
    return {}


def describe(instruction_id: str, kwargs: dict) -> str:
    """IFEval's wording for the instruction with these arguments; refuses a random draw."""
    checker = INSTRUCTION_DICT[instruction_id](instruction_id)
    text = checker.build_description(**kwargs)
    if (checker.get_instruction_args() or {}) != kwargs:
        raise ValueError(f"{instruction_id}: the checker holds {checker.get_instruction_args()}"
                         f" for {kwargs}")
    return text


def join(parts: list[str]) -> str:
    """The base task and descriptions: a space after a sentence's end, else a newline."""
    text = parts[0]
    for part in parts[1:]:
        text += (" " if text.endswith((".", "?", "!", ")", '"')) else "\n") + part
    return text


def make_row(rng: random.Random, split: str, n: int, ids: list[str], base_task: str) -> dict:
    """The IFEval row for these ids on this base task."""
    words = WordDraw(rng, base_task)
    others = [i for i in ids if i != REPEAT]
    kwargs = [draw_kwargs(rng, i, ids, words) for i in others]
    request = join([base_task] + [describe(i, k) for i, k in zip(others, kwargs, strict=True)])
    prompt = request
    if REPEAT in ids:
        kwargs.append({"prompt_to_repeat": request})
        prompt = request + "\n" + describe(REPEAT, kwargs[-1])
    return {"id": f"{split}-{n}", "key": n, "prompt": prompt, "instruction_id_list": ids,
            "kwargs": kwargs}


def make_split(rng: random.Random, split: str, part: dict[str, list[str]]) -> list[Drawn]:
    """The split's prompts, each on a base task new to it."""
    out: list[Drawn] = []
    used: set[str] = set()
    for n in range(SPLITS[split]):
        ids = draw_ids(rng)
        task, slot, filler = draw_base_task(rng, ids, part, used)
        used.add(task)
        out.append(Drawn(task, slot, filler, make_row(rng, split, n, ids, task)))
    return out


def make_all(seed: int) -> dict[str, list[Drawn]]:
    """Every split, drawn by one generator in a fixed order."""
    rng = random.Random(seed)
    parts = cut_pools(rng)
    return {split: make_split(rng, split, parts[split]) for split in SPLITS}


def readme(seed: int, splits: dict[str, list[Drawn]]) -> str:
    """The summary: sizes, how to regenerate, the instruction histograms per split."""
    names = list(splits)
    rows = {s: [d.row for d in drawn] for s, drawn in splits.items()}
    per_id = {s: Counter(i for r in rs for i in r["instruction_id_list"]) for s, rs in rows.items()}
    per_n = {s: Counter(len(r["instruction_id_list"]) for r in rs) for s, rs in rows.items()}
    lines = [
        "# Verifiable-instruction prompts (issue 43)",
        "",
        "Generated by `scripts/make_instruction_prompts.py` (its docstring says exactly how);"
        " do not edit by hand. Regenerate with",
        "",
        "```",
        f".venv/bin/python scripts/make_instruction_prompts.py --seed {seed}"
        " --out jobs/instructions",
        "```",
        "",
        "Rows are IFEval's format plus an id (`id`, `key`, `prompt`, `instruction_id_list`,"
        " `kwargs`); each prompt is a base task of our own plus 1 to 3 instructions from"
        " if-verifiable's IFEval registry, in IFEval's wording. The splits share no topic,"
        " thing, goal or place: `bench` is the SBoN benchmark's set, `train` the expert"
        " iteration's prompts, `eval` the held-out evaluation.",
        "",
        "| split | prompts | instructions |",
        "| --- | ---: | ---: |",
        *(f"| `{s}` | {len(rows[s])} | {sum(per_id[s].values())} |" for s in names),
        "",
        "Instructions per prompt:",
        "",
        "| instructions | " + " | ".join(f"`{s}`" for s in names) + " |",
        "| --- |" + " ---: |" * len(names),
        *(f"| {n} | " + " | ".join(str(per_n[s][n]) for s in names) + " |" for n in (1, 2, 3)),
        "",
        "Prompts carrying each instruction id:",
        "",
        "| instruction id | " + " | ".join(f"`{s}`" for s in names) + " |",
        "| --- |" + " ---: |" * len(names),
        *(f"| `{i}` | " + " | ".join(str(per_id[s][i]) for s in names) + " |"
          for i in USABLE_IDS),
        "",
        "Left out of the draw: " + ", ".join(f"`{i}`" for i in EXCLUDED_IDS)
        + " (their checkers need nltk's punkt data, which an offline machine lacks).",
        "",
    ]
    return "\n".join(lines)


def write(out: Path, seed: int, splits: dict[str, list[Drawn]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for split, drawn in splits.items():
        text = "".join(json.dumps(d.row) + "\n" for d in drawn)
        (out / f"{split}.jsonl").write_text(text, encoding="utf-8")
    (out / "README.md").write_text(readme(seed, splits), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="folder for bench.jsonl, train.jsonl, eval.jsonl and README.md")
    args = parser.parse_args(argv)
    try:
        write(args.out, args.seed, make_all(args.seed))
    except OSError as e:
        print(f"make_instruction_prompts: cannot write to {args.out}: {e.strerror}",
              file=sys.stderr)
        return 2
    print(f"wrote {', '.join(f'{s}.jsonl ({n})' for s, n in SPLITS.items())} and README.md"
          f" to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
