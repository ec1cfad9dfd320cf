#!/usr/bin/env python3
"""Per-kernel table of a decode step from `ncu --csv --print-units base` output with the metrics
gpu__time_duration.sum, dram__bytes_read.sum and dram__bytes_write.sum
(scripts/device/profile_decode_step.sh). A decode step starts at an embedding kernel; the table
covers the last complete step (from the second-to-last embedding launch to the last) and, for
comparison, the step after it (to the end of the run). Without two embedding launches, the
shortest repeating tail of the kernel sequence is taken as a step.

    python3 scripts/device/ncu_step_table.py ncu.csv
"""
import collections
import csv
import re
import sys


def short_name(name):
    # "void nq::kernels::cuda::(anonymous namespace)::Foo<float, 4>(Params)" -> "Foo<float, 4>"
    name = re.sub(r"\(anonymous namespace\)::", "", name)
    name = re.sub(r"^void ", "", name)
    depth, cut = 0, len(name)
    for i, c in enumerate(name):
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif c == "(" and depth == 0:
            cut = i
            break
    name = name[:cut]
    if "<" not in name:
        return name.split("::")[-1]
    colons = name.rfind("::", 0, name.find("<"))
    return name if colons < 0 else name[colons + 2:]


def read_kernels(path):
    kernels = collections.OrderedDict()
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    for row in csv.DictReader(lines):
        kid = int(row["ID"])
        k = kernels.setdefault(kid, {"name": short_name(row["Kernel Name"]), "grid": row.get("Grid Size", ""),
                                     "ns": 0.0, "read": 0.0, "write": 0.0})
        value = float(row["Metric Value"].replace(",", "")) if row["Metric Value"] not in ("", "n/a") else 0.0
        metric = row["Metric Name"]
        if metric.startswith("gpu__time_duration"):
            k["ns"] = value
        elif metric.startswith("dram__bytes_read"):
            k["read"] = value
        elif metric.startswith("dram__bytes_write"):
            k["write"] = value
    return list(kernels.values())


def table(title, kernels):
    total_ns = sum(k["ns"] for k in kernels)
    total_bytes = sum(k["read"] + k["write"] for k in kernels)
    print(f"== {title}: {len(kernels)} kernels, {total_ns / 1e3:.1f} us of kernel time, "
          f"{total_bytes / 1e6:.1f} MB DRAM traffic ({total_bytes / max(total_ns, 1):.0f} GB/s over kernel time)")
    groups = collections.OrderedDict()
    for k in kernels:
        g = groups.setdefault(k["name"], {"n": 0, "ns": 0.0, "bytes": 0.0})
        g["n"] += 1
        g["ns"] += k["ns"]
        g["bytes"] += k["read"] + k["write"]
    print(f"{'kernel':64} {'calls':>5} {'us':>9} {'share':>6} {'MB':>9} {'GB/s':>7}")
    for name, g in sorted(groups.items(), key=lambda kv: -kv[1]["ns"]):
        print(f"{name[:64]:64} {g['n']:5d} {g['ns'] / 1e3:9.1f} {g['ns'] / max(total_ns, 1):6.3f} "
              f"{g['bytes'] / 1e6:9.2f} {g['bytes'] / max(g['ns'], 1):7.0f}")


def calls(title, kernels, name):
    """Each call of kernel `name` in order: grid, time, DRAM bytes and rate."""
    print(f"== {title}: every {name} call")
    for k in kernels:
        if k["name"] == name:
            moved = k["read"] + k["write"]
            print(f"  grid {k['grid']:>14} {k['ns'] / 1e3:8.1f} us {moved / 1e6:8.2f} MB {moved / max(k['ns'], 1):6.0f} GB/s")


def repeating_tail(kernels, min_period=8):
    """The shortest p whose last two runs of p kernels have the same names in the same order."""
    names = [k["name"] for k in kernels]
    for p in range(min_period, len(names) // 2 + 1):
        if names[-p:] == names[-2 * p:-p]:
            return p
    return None


def main():
    kernels = read_kernels(sys.argv[1])
    starts = [i for i, k in enumerate(kernels) if "Embedding" in k["name"]]
    if len(starts) < 2:
        # No embedding kernel to start each step: the run's last steps are the same kernels in
        # the same order, so the shortest period of the sequence's tail is a step.
        period = repeating_tail(kernels)
        if period is None:
            print(f"{len(kernels)} kernels, {len(starts)} embedding launches, no repeating tail: no whole decode step")
            print("most frequent kernels:", collections.Counter(k["name"] for k in kernels).most_common(12))
            return 1
        print(f"{len(starts)} embedding launches: steps taken as the run's repeating tail, {period} kernels each")
        starts = [len(kernels) - 2 * period, len(kernels) - period]
    table("last whole decode step", kernels[starts[-2]:starts[-1]])
    table("the step after it (to the end of the run)", kernels[starts[-1]:])
    step = kernels[starts[-2]:starts[-1]]
    by_time = collections.Counter()
    for k in step:
        by_time[k["name"]] += k["ns"]
    for name, _ in by_time.most_common(2):
        calls("last whole decode step", step, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
