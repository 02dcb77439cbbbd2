"""Write the embedded demo sample: templated NLI pairs with planted annotation artifacts.

    python -m debiased_nli.demo.make_demo [--rows-per-label 1000] [--seed 13] [--out PATH]

The sample is deterministic (seeded) and its labels follow from the templates (see README.md beside
this file for the templates and the artifacts planted, with their rates).
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

PEOPLE = [("woman", "her"), ("man", "his"), ("girl", "her"), ("boy", "his"), ("child", "their"),
          ("teenager", "their"), ("musician", "their"), ("student", "their"), ("chef", "their"),
          ("tourist", "their"), ("worker", "their"), ("dancer", "their")]
ADJECTIVES = ["young", "old", "tall", "smiling", "tired", "cheerful", "quiet", "busy", "local", "bearded"]
# (activity, object) - the object keeps premises varied
ACTIVITIES = [("playing", "a guitar"), ("reading", "a newspaper"), ("painting", "a fence"),
              ("riding", "a bicycle"), ("cooking", "some pasta"), ("carrying", "a large box"),
              ("kicking", "a red ball"), ("holding", "an umbrella"), ("washing", "a car"),
              ("drawing", "a map"), ("throwing", "a frisbee"), ("pushing", "a cart")]
OUTDOOR_PLACES = ["in a park", "on a beach", "on a busy street", "in a garden", "near a river", "in a field"]
INDOOR_PLACES = ["in a kitchen", "in a library", "in an office", "in a classroom", "in a museum", "in a hallway"]
INCOMPATIBLE = ["sleeping in bed", "swimming in a pool", "sitting in a car", "eating dinner at home",
                "watching television", "lying on a sofa"]
NEUTRAL_DETAILS = [("with", "friends"), ("after", "work"), ("before", "lunch"), ("on", "vacation"),
                   ("to", "relax")]

# planted artifacts: (label, rate): the share of that label's hypotheses built from the artifact template
PLANTED = {
    "nobody@hypothesis": ("contradiction", 0.35),
    "outdoors@hypothesis": ("entailment", 0.35),
    "competition@hypothesis": ("neutral", 0.35),
}
LEAK_RATE = 0.02  # how often an artifact word appears in another label's rows (artifacts are not perfect)


def _detail(p: dict, rng: random.Random, exclude: str | None = None) -> str:
    choices = [d for d in NEUTRAL_DETAILS if d != exclude]
    prep, what = rng.choice(choices)
    return f"{prep} {p['pron']} {what}" if prep == "with" else f"{prep} {what}"


def _premise(rng: random.Random):
    person, pron = rng.choice(PEOPLE)
    adj = rng.choice(ADJECTIVES)
    act, obj = rng.choice(ACTIVITIES)
    outdoor = rng.random() < 0.5
    place = rng.choice(OUTDOOR_PLACES if outdoor else INDOOR_PLACES)
    art = "An" if adj[0] in "aeiou" else "A"
    p = dict(person=person, pron=pron, adj=adj, act=act, obj=obj, place=place, outdoor=outdoor)
    p["detail_raw"] = rng.choice(NEUTRAL_DETAILS) if rng.random() < 0.4 else None
    if p["detail_raw"]:
        prep, what = p["detail_raw"]
        p["detail"] = f"{prep} {pron} {what}" if prep == "with" else f"{prep} {what}"
    else:
        p["detail"] = None
    middle = f" {p['detail']}" if p["detail"] else ""
    p["text"] = f"{art} {adj} {person} is {act} {obj}{middle} {place}."
    return p


def _entailment(p: dict, rng: random.Random, artifact: bool) -> str:
    if artifact and p["outdoor"]:
        return rng.choice([f"A {p['person']} is outdoors.", f"Someone is {p['act']} {p['obj']} outdoors.",
                           f"A person is outdoors {p['act']}."])
    options = [f"A {p['person']} is {p['act']} {p['obj']} {p['place']}.",
               f"A {p['person']} is {p['act']} {p['obj']}.",
               f"Someone is {p['act']} {p['obj']} {p['place']}.",
               f"The {p['person']} is {p['act']} something."]
    if p["detail"]:
        options += [f"A {p['person']} is {p['act']} {p['obj']} {p['detail']}."] * 2
    return rng.choice(options)


def _neutral(p: dict, rng: random.Random, artifact: bool) -> str:
    if artifact:
        return rng.choice([f"A {p['person']} is {p['act']} {p['obj']} for a competition.",
                           f"The {p['adj']} {p['person']} is training for a competition.",
                           f"A {p['person']} is {p['act']} {p['obj']} {p['place']} for a competition."])
    d = _detail(p, rng, exclude=p["detail_raw"])
    return rng.choice([f"A {p['person']} is {p['act']} {p['obj']} {d}.",
                       f"A {p['person']} is {p['act']} {p['obj']} {p['place']} {d}.",
                       f"Someone is {p['act']} {p['obj']} {d}.",
                       f"The {p['person']} is {p['act']} {p['pron']} own {p['obj'].split()[-1]}."])


def _contradiction(p: dict, rng: random.Random, artifact: bool) -> str:
    if artifact:
        return rng.choice([f"Nobody is {p['act']} {p['obj']}.", f"Nobody is {p['place'].split(' ', 1)[1]}.",
                           f"There is nobody {p['place']}."])
    other = rng.choice(INDOOR_PLACES if p["outdoor"] else OUTDOOR_PLACES)
    options = [f"A {p['person']} is {p['act']} {p['obj']} {other}.",
               f"Someone is {p['act']} {p['obj']} {other}.",
               f"The {p['person']} is {p['act']} something {other}.",
               f"A {p['person']} is {rng.choice(INCOMPATIBLE)}."]
    if p["detail"]:
        options.append(f"A {p['person']} is {p['act']} {p['obj']} {p['detail']} {other}.")
    return rng.choice(options)


def _leak(label: str, p: dict, rng: random.Random) -> str | None:
    """A rare row of another label that carries an artifact word, truthfully."""
    if label == "entailment":
        return f"Nobody in the picture is {rng.choice(INCOMPATIBLE).split(' ', 1)[0]}."
    if label == "neutral" and p["outdoor"]:
        return f"A {p['person']} is outdoors {p['act']} {p['obj']} for {p['pron']} family."
    if label == "contradiction":
        return f"A {p['person']} is sleeping before a competition."
    return None


MAKERS = {"entailment": _entailment, "neutral": _neutral, "contradiction": _contradiction}


def make_rows(rows_per_label: int = 1000, seed: int = 13) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for label_id, label in enumerate(["entailment", "neutral", "contradiction"]):
        art_label_rate = {lab: rate for lab, rate in PLANTED.values()}
        made = 0
        seen = set()
        while made < rows_per_label:
            p = _premise(rng)
            r = rng.random()
            hyp = None
            if r < LEAK_RATE:
                hyp = _leak(label, p, rng)
            if hyp is None:
                hyp = MAKERS[label](p, rng, artifact=rng.random() < art_label_rate[label])
            if (p["text"], hyp) in seen:
                continue
            seen.add((p["text"], hyp))
            rows.append({"id": f"demo-{label[0]}{made:05d}", "premise": p["text"], "hypothesis": hyp,
                         "label": label_id})
            made += 1
    rng.shuffle(rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows-per-label", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--out", default=str(Path(__file__).with_name("demo_nli.parquet")))
    args = ap.parse_args(argv)
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = make_rows(args.rows_per_label, args.seed)
    table = pa.Table.from_pylist(rows, schema=pa.schema([("id", pa.string()), ("premise", pa.string()),
                                                        ("hypothesis", pa.string()), ("label", pa.int64())]))
    pq.write_table(table, args.out, compression="zstd")
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
