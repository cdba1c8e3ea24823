"""Which buffers are live at the peak of an XLA dump's live ranges (rough: every value
counted at its shape's size, aliases not merged).

    python experiments/live_peak.py DUMP_DIR [top]
"""
import glob
import re
import sys

from jax_seqpar.tools.hlo_text import parse_module, shape_bytes, split_top_level

d = sys.argv[1]
top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
text = open(glob.glob(f"{d}/*after_optimizations.txt")[0]).read()
comps, entry = parse_module(text)
shapes = {i.name: (i.shape, i.opcode, c) for c, insts in comps.items() for i in insts}
lr = open(glob.glob(f"{d}/*live-range.txt")[0]).read()
seq = dict((int(a), b) for a, b in re.findall(r"^\s+(\d+):(\S+)$", lr.split("BufferLiveRange")[0], re.M))
ranges = re.findall(r"^\s+([\w.\-]+)\{([\d,]*)\}:(\d+)-(\d+)$", lr.split("BufferLiveRange")[1], re.M)


def elem(shape, index):
    for i in [int(x) for x in index.split(",") if x]:
        shape = split_top_level(shape.strip()[1:-1])[i]
    return shape


vals = []
for name, index, a, b in ranges:
    if name not in shapes:
        continue
    shape, op, comp = shapes[name]
    try:
        s = elem(shape, index)
    except Exception:
        continue
    if s.strip().startswith("("):
        continue
    vals.append((name, index, int(a), int(b), shape_bytes(s), op, comp, s))
end = max(v[3] for v in vals)
usage = [0.0] * (end + 2)
for v in vals:
    for t in range(v[2], v[3] + 1):
        usage[t] += v[4]
peak = max(range(len(usage)), key=usage.__getitem__)
print(f"peak {usage[peak] / 2**20:.1f} MiB at step {peak} ({seq.get(peak)})")
live = sorted((v for v in vals if v[2] <= peak <= v[3]), key=lambda v: -v[4])
for v in live[:top]:
    print(f"  {v[4] / 2**20:7.1f} MiB {v[5]:24s} {v[0][:40]:40s} [{v[2]}-{v[3]}] {v[6][:30]} {re.sub(r'{[^}]*}', '', v[7])[:40]}")
