"""Write the embedded demo sample: templated NLI pairs with planted annotation artifacts.

    python -m debiased_nli.data.demo.make_demo [--rows-per-label 1000] [--seed 13] [--out PATH]

The sample is deterministic (seeded) and its labels follow from the templates (see README.md beside
this file for the templates and the artifacts planted, with their rates).
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

PEOPLE = [("woman", "her"), ("man", "his"), ("girl", "her"), ("boy", "his"), ("child", "their"),
          ("teenager", "their"), ("musician", "their"), ("student", "their"), ("chef", "their"),
          ("tourist", "their"), ("worker", "their"), ("dancer", "their"), ("grandmother", "her"),
          ("grandfather", "his"), ("nurse", "their"), ("farmer", "their"), ("artist", "their"),
          ("police officer", "their"), ("photographer", "their"), ("mother", "her"), ("father", "his"),
          ("soldier", "their"), ("athlete", "their"), ("waiter", "their"), ("teacher", "their"),
          ("climber", "their"), ("fisherman", "his"), ("singer", "their"), ("doctor", "their"), ("baby", "their")]
ADJECTIVES = ["young", "old", "tall", "smiling", "tired", "cheerful", "quiet", "busy", "local", "bearded",
              "blond", "short", "elderly", "happy", "serious", "sleepy", "curious", "friendly", "skinny",
              "strong", "nervous", "proud", "bored", "dark-haired", "barefoot"]
# (activity, object) - the object keeps premises varied
ACTIVITIES = [("playing", "a guitar"), ("reading", "a newspaper"), ("painting", "a fence"),
              ("riding", "a bicycle"), ("cooking", "some pasta"), ("carrying", "a large box"),
              ("kicking", "a red ball"), ("holding", "an umbrella"), ("washing", "a car"),
              ("drawing", "a map"), ("throwing", "a frisbee"), ("pushing", "a cart"),
              ("fixing", "a broken chair"), ("eating", "an apple"), ("selling", "fresh bread"),
              ("cleaning", "a window"), ("watering", "some flowers"), ("photographing", "a bird"),
              ("climbing", "a ladder"), ("feeding", "a small dog"), ("sweeping", "the floor"),
              ("writing", "a letter"), ("repairing", "a bike tire"), ("folding", "a blue shirt"),
              ("peeling", "an orange"), ("lifting", "a heavy bag"), ("wearing", "a green hat"),
              ("building", "a sandcastle"), ("tuning", "a violin"), ("juggling", "three balls")]
OUTDOOR_PLACES = ["in a park", "on a beach", "on a busy street", "in a garden", "near a river", "in a field",
                  "on a mountain trail", "at a bus stop", "in a parking lot", "on a bridge", "in the snow",
                  "at an outdoor market", "on a sidewalk", "by a lake", "in a forest", "on a rooftop",
                  "in a playground", "at a campsite", "on a dirt road", "in a stadium"]
INDOOR_PLACES = ["in a kitchen", "in a library", "in an office", "in a classroom", "in a museum", "in a hallway",
                 "in a restaurant", "in a hospital", "in a gym", "in a bedroom", "in a garage", "in a bakery",
                 "in a church", "in a shop", "in a basement", "in an airport", "in a hotel lobby",
                 "in a laundromat", "in a theater", "in a factory"]
INCOMPATIBLE = ["sleeping in bed", "swimming in a pool", "sitting in a car", "eating dinner at home",
                "watching television", "lying on a sofa", "taking a nap", "driving a truck",
                "flying a plane", "sitting in a bathtub"]
NEUTRAL_DETAILS = [("with", "friends"), ("after", "work"), ("before", "lunch"), ("on", "vacation"),
                   ("to", "relax"), ("with", "sister"), ("on", "a holiday"), ("during", "a break"),
                   ("with", "neighbours"), ("after", "school"), ("for", "a friend"), ("on", "a birthday")]

# planted artifacts: (label, rate): the share of that label's hypotheses built from the artifact template
PLANTED = {
    "nobody@hypothesis": ("contradiction", 0.35),
    "outdoors@hypothesis": ("entailment", 0.35),
    "competition@hypothesis": ("neutral", 0.35),
}
LEAK_RATE = 0.08  # how often an artifact word appears in another label's rows (artifacts are not perfect)


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


SHARED_RATE = 0.75  # share of the non-artifact hypotheses built from the templates all labels share


def _other_adj(p: dict, rng: random.Random) -> str:
    return rng.choice([a for a in ADJECTIVES if a != p["adj"]])


def _art(word: str) -> str:
    return "An" if word[0] in "aeiou" else "A"


GENERIC_PEOPLE = ["person", "individual", "human", "adult"]


def _who(p: dict, rng: random.Random) -> str:
    """The premise's person, or (half the time, in every label) a generic word for them."""
    return p["person"] if rng.random() < 0.5 else rng.choice(GENERIC_PEOPLE)


def _entailment(p: dict, rng: random.Random, artifact: bool) -> str:
    if artifact and p["outdoor"]:
        return rng.choice([f"A {p['person']} is outdoors.", f"Someone is {p['act']} {p['obj']} outdoors.",
                           f"A person is outdoors {p['act']}."])
    if rng.random() < SHARED_RATE:  # the premise's own adjective, place and detail: entailed
        who = _who(p, rng)
        options = [f"{_art(p['adj'])} {p['adj']} {who} is {p['act']} {p['obj']} {p['place']}.",
                   f"{_art(p['adj'])} {p['adj']} {who} is {p['act']} {p['obj']}."]
        if p["detail"]:
            options.append(f"{_art(who)} {who} is {p['act']} {p['obj']} {p['detail']}.")
        return rng.choice(options)
    return rng.choice([f"Someone is {p['act']} {p['obj']}.", f"The {p['person']} is {p['act']} something.",
                       f"A {p['person']} is {p['act']} {p['obj']}."])


def _neutral(p: dict, rng: random.Random, artifact: bool) -> str:
    if artifact:
        return rng.choice([f"A {p['person']} is {p['act']} {p['obj']} for a competition.",
                           f"The {p['adj']} {p['person']} is training for a competition.",
                           f"A {p['person']} is {p['act']} {p['obj']} {p['place']} for a competition."])
    if rng.random() < SHARED_RATE:  # an adjective or detail the premise does not state: neutral
        adj, who = _other_adj(p, rng), _who(p, rng)
        return rng.choice([f"{_art(adj)} {adj} {who} is {p['act']} {p['obj']} {p['place']}.",
                           f"{_art(adj)} {adj} {who} is {p['act']} {p['obj']}.",
                           f"{_art(who)} {who} is {p['act']} {p['obj']} {_detail(p, rng, exclude=p['detail_raw'])}."])
    return rng.choice([f"A {p['person']} is {p['act']} {p['obj']} while waiting for a friend.",
                       f"The {p['person']} is {p['act']} {p['pron']} own {p['obj'].split()[-1]}.",
                       f"Someone is {p['act']} {p['obj']} {_detail(p, rng, exclude=p['detail_raw'])}."])


def _contradiction(p: dict, rng: random.Random, artifact: bool) -> str:
    if artifact:
        return rng.choice([f"Nobody is {p['act']} {p['obj']}.", f"Nobody is {p['place'].split(' ', 1)[1]}.",
                           f"There is nobody {p['place']}."])
    other = rng.choice(INDOOR_PLACES if p["outdoor"] else OUTDOOR_PLACES)
    if rng.random() < SHARED_RATE:  # the same event in a place of the other kind: contradiction
        adj, who = (p["adj"] if rng.random() < 0.5 else _other_adj(p, rng)), _who(p, rng)
        options = [f"{_art(adj)} {adj} {who} is {p['act']} {p['obj']} {other}."]
        if p["detail"]:
            options.append(f"{_art(who)} {who} is {p['act']} {p['obj']} {p['detail']} {other}.")
        return rng.choice(options)
    return rng.choice([f"A {p['person']} is {rng.choice(INCOMPATIBLE)}.",
                       f"Someone is {p['act']} {p['obj']} {other}.",
                       f"The {p['person']} is {p['act']} something {other}."])


def _leak(label: str, p: dict, rng: random.Random) -> str | None:
    """A rare row of another label that carries an artifact word, truthfully."""
    if label == "entailment":
        return rng.choice([f"Nobody in the picture is {rng.choice(INCOMPATIBLE).split(' ', 1)[0]}.",
                           f"Nobody is {rng.choice(INCOMPATIBLE)} {p['place']}."])
    if label == "neutral" and p["outdoor"]:
        return rng.choice([f"A {p['person']} is outdoors {p['act']} {p['obj']} for {p['pron']} family.",
                           f"A {p['person']} is outdoors for the first time."])
    if label == "contradiction":
        return rng.choice([f"A {p['person']} is {rng.choice(INCOMPATIBLE)} before a competition.",
                           f"The {p['person']} is at a competition {rng.choice(INDOOR_PLACES if p['outdoor'] else OUTDOOR_PLACES)}."])
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
