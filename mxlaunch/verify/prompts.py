"""The built-in prompt set for `mxlaunch verify`, and loading a user's own prompt file.

The set is chosen to touch many code paths of a tokenizer and a model: code, arithmetic, several
languages and scripts, unicode (emoji, combining marks, right-to-left), JSON, a long prose prompt
(≥ 700 tokens for common tokenizers: it exercises long attention and chunked prefill), repetition,
rare tokens and a dialogue. Names are stable: gold files and reports refer to prompts by name.
"""

from __future__ import annotations

import json
from pathlib import Path

from mxlaunch.errors import UsageError

_LONG_PROSE = """\
The harbour town woke slowly in winter. Before the first bus rattled down the hill, the baker had \
already pulled three trays of bread from the oven, and the smell drifted over the wet cobblestones \
to the fishermen who were untying their boats. Nobody spoke much at that hour. A nod was enough, or \
a raised hand, or the short whistle that old Marten used to call his dog back from the water's edge.

Marten had kept the lighthouse on the point for thirty-one years. When the lamp was finally \
automated, the harbour board offered him a small pension and a room above the chandlery, but he \
refused both and stayed in the keeper's cottage, which nobody else wanted anyway. He still climbed \
the tower every evening, not because the light needed him, but because he needed to see it come on. \
He said that a machine could turn a switch, but it could not notice when the fog was thickening \
over the reef, or when a trawler was running too close to the rocks with its radio switched off.

The children of the town thought he was a wizard. He let them believe it. On Saturdays they came \
up the path with questions written on scraps of paper: why the sea was salty, why the moon changed \
shape, whether whales could hear each other across the whole ocean. He answered every one, slowly, \
drawing diagrams in the sand with a piece of driftwood. When he did not know an answer he said so, \
and then he wrote the question in a notebook and promised to find out. Over the years the notebook \
filled up, and then a second one, and a third, until a whole shelf of the cottage held nothing but \
children's questions and an old man's careful answers.

One autumn a storm came in faster than the forecast had promised. The wind swung round to the \
north-west in the middle of the afternoon and the temperature dropped by ten degrees in an hour. \
Three boats were still out beyond the reef. Marten watched them from the gallery of the tower with \
his binoculars, counting the seconds between the waves and the spray that exploded over the outer \
rocks. The automatic lamp came on at its usual time, exactly as it had been programmed to do, but \
the rain was so heavy that its beam seemed to stop a few hundred metres from the tower, swallowed \
by the grey.

He went down to the storeroom and found the old signal lamp, the one with the heavy brass shutter, \
and carried it back up the two hundred and twelve steps. Then he began to flash the pattern that \
every fisherman in the town had learned as a child: long, short, long, pause; the safe channel is to \
the south of the light. He kept it up for nearly two hours, changing hands when his arms grew tired, \
until the last of the three boats rounded the breakwater and its crew stood on the quay, soaked and \
shaking, looking up at the point.

Nobody made a speech about it afterwards. The harbour board sent a letter that thanked him for his \
initiative and reminded him, in the same paragraph, that the tower was no longer his responsibility. \
The fishermen said nothing at all, but the next morning there was a loaf of bread on his doorstep, \
and a bag of coffee, and a new pair of gloves, and the morning after that there was more. It went on \
all winter. In the spring the children came back with their scraps of paper, and the first question \
of the year, written in careful capital letters, was: how do you know when someone needs the light?

Marten thought about that one for a long time. He did not draw anything in the sand. In the end he \
said that you never really know, and that this is exactly why you keep watching: the sea does not \
send a message before it changes its mind, and neither do people. You keep the lamp clean, you keep \
the shutter oiled, and you look out of the window more often than seems necessary. Most nights \
nothing happens. You do it for the one night when something does. The child wrote the answer down, \
folded the paper twice, and put it in her pocket, and years later, when she was the one who kept the \
harbour's records, she pinned it above her desk where she could see it every day."""

_REPETITION = "the cat sat on the mat. " * 24 + "the cat sat on the"

_RARE = (
    "ꙮ ⸻ ﷽ 𒀱 𓂀 ᚠᛇᚻ ⁂ ℵ₀ ∮ ⨌ ꧁꧂ 〄 ㉿ 🜁 🝳 "
    "zxqvj qwxz pfft brrr grrrr xkcd yyyy zzzz \u00ad\u200b\u2060 \ufeff end"
)

BUILTIN_PROMPTS: list[dict[str, str]] = [
    {"name": "code-python", "text": "def quicksort(xs: list[int]) -> list[int]:\n    \"\"\"Sort a list of integers.\"\"\"\n    if len(xs) <= 1:\n        return xs\n"},
    {"name": "code-c", "text": "#include <stdio.h>\n\nint main(void) {\n    for (int i = 0; i < 10; ++i) {\n        printf(\"%d\\n\", i * i);\n    }\n"},
    {"name": "arithmetic", "text": "Compute step by step: 17 * 23 = 391; 391 + 1024 = 1415; 1415 / 5 = 283; 283 - 99 ="},
    {"name": "numbers", "text": "3.14159265358979 2.71828182845904 1.41421356237309 0.5772156649 6.02214076e23 -0.000001 1e-9 0x7fffffff"},
    {"name": "english", "text": "The history of the printing press begins in the fifteenth century, when"},
    {"name": "french", "text": "Il était une fois, dans un petit village au bord de la mer, une vieille femme qui"},
    {"name": "german", "text": "Die Donaudampfschifffahrtsgesellschaftskapitänsmütze lag auf dem Tisch, als plötzlich"},
    {"name": "chinese", "text": "从前有一座山，山里有一座庙，庙里有一个老和尚正在给小和尚讲故事。他说："},
    {"name": "japanese", "text": "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。"},
    {"name": "russian-arabic-hindi", "text": "Привет, мир! مرحبا بالعالم! नमस्ते दुनिया! Γειά σου κόσμε! שלום עולם!"},
    {"name": "unicode-emoji", "text": "Weather: ☀️🌧️⛈️❄️ — family: 👨‍👩‍👧‍👦, flags: 🇯🇵🇧🇷🇰🇪, skin tones: 👋🏻👋🏿, combining: e\u0301 n\u0303 a\u030a Z\u0335\u0321a\u0336\u0315l\u0334g\u0337o\u0338"},
    {"name": "json", "text": "{\"id\": 42, \"name\": \"Ada Lovelace\", \"tags\": [\"math\", \"engine\"], \"active\": true, \"score\": 9.75, \"nested\": {\"a\": null, \"b\": [1, 2, {\"c\": \"ü\"}]}, \"next\":"},
    {"name": "long-prose", "text": _LONG_PROSE},
    {"name": "repetition", "text": _REPETITION},
    {"name": "rare-tokens", "text": _RARE},
    {"name": "dialogue", "text": "User: My train was cancelled and I need to be in Lyon by nine tomorrow.\nAssistant: I'm sorry to hear that. Are you travelling from Paris?\nUser: Yes, from Gare de Lyon.\nAssistant:"},
    {"name": "whitespace-markup", "text": "<html>\n  <body>\n\t<p class=\"x\">Tabs\tand   spaces</p>\n  </body>\n</html>\n| a | b |\n|---|---|\n| 1 | 2 |\n"},
    {"name": "single-char", "text": "A"},
]


def load_prompts(path: Path | None) -> list[dict[str, str]]:
    """The built-in set, or a user's file.

    Accepted files: ``.json`` — a list of strings or of ``{"name": ..., "text"|"prompt": ...}`` objects;
    ``.jsonl`` — one string or object per line; anything else — plain text, one prompt per non-empty line.
    """
    if path is None:
        return [dict(p) for p in BUILTIN_PROMPTS]
    try:
        raw = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read prompts file {path}: {exc.__class__.__name__}: {exc}",
                         "pass a readable UTF-8 file") from None
    suffix = Path(path).suffix.lower()
    try:
        if suffix == ".json":
            items = json.loads(raw)
            if not isinstance(items, list):
                raise ValueError("top level is not a list")
        elif suffix == ".jsonl":
            items = [json.loads(line) for line in raw.splitlines() if line.strip()]
        else:
            items = [line for line in raw.splitlines() if line.strip()]
    except (ValueError, json.JSONDecodeError) as exc:
        raise UsageError(f"prompts file {path} is not valid {suffix[1:] or 'text'}: {exc}",
                         "use a JSON list of strings or {\"name\", \"text\"} objects") from None
    prompts: list[dict[str, str]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            name, text = f"p{i:03d}", item
        elif isinstance(item, dict) and isinstance(item.get("text", item.get("prompt")), str):
            text = item.get("text", item.get("prompt"))
            name = str(item.get("name", f"p{i:03d}"))
        else:
            raise UsageError(f"prompts file {path}: item {i} is neither a string nor an object with \"text\"",
                             "use a JSON list of strings or {\"name\", \"text\"} objects")
        if not text:
            raise UsageError(f"prompts file {path}: item {i} is an empty prompt", "remove it")
        prompts.append({"name": name, "text": text})
    if not prompts:
        raise UsageError(f"prompts file {path} holds no prompts", "add at least one prompt")
    names = [p["name"] for p in prompts]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UsageError(f"prompts file {path}: duplicate prompt names {dup[:3]}", "give every prompt a unique name")
    return prompts
