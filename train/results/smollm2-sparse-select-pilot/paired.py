"""The README's paired comparisons: select minus control copy NLL over the 16 held-out sequences
(8 per split, the same in both arms), mean and 95% t interval.  python paired.py eval36.json select36 control36"""
import json, math, statistics, sys

d = json.load(open(sys.argv[1]))
a_name, b_name = sys.argv[2], sys.argv[3]
T95 = {15: 2.131}  # t(0.975, n - 1) for the 16 sequences
for mode in ("sparse", "dense"):
    per = lambda name: [x for r in d[name] if r["mode"] == mode for x in r["copy_nll_per_sample"]]
    diff = [x - y for x, y in zip(per(a_name), per(b_name))]
    half = T95[len(diff) - 1] * statistics.stdev(diff) / math.sqrt(len(diff))
    print(f"{mode}: {a_name} - {b_name} copy NLL {statistics.mean(diff):+.3f} +- {half:.3f} nats ({len(diff)} sequences)")
