"""sha256 of every output file of notes/byte_identity.sh in OUT (argv[1]): JSON with its wall-clock fields
zeroed, a card with its times blanked. Writes OUT/sha256.txt."""
import hashlib, json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
def scrub(obj):
    if isinstance(obj, dict):
        return {k: (0 if k in ("seconds", "wall_seconds", "elapsed_s", "created", "date", "operations_per_second") else scrub(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v) for v in obj]
    return obj
lines = []
for d in ("demo", "snli20k", "rebuild_v1_kept", "seqz_rebuild", "tiny"):
    for p in sorted((out / d).rglob("*")):
        if not p.is_file():
            continue
        b = p.read_bytes()
        if p.suffix == ".json":
            try:
                b = json.dumps(scrub(json.loads(b)), sort_keys=True).encode()
            except ValueError:
                pass
        elif p.name == "README.md":  # the card quotes the manifest's seconds
            b = re.sub(rb"[0-9.]+ ?s\b|[0-9.,]+ per second", b"<s>", b)
        lines.append(f"{hashlib.sha256(b).hexdigest()}  {p.relative_to(out)}")
(out / "sha256.txt").write_text("\n".join(lines) + "\n")
print(len(lines), "files")
