#!/usr/bin/env python3
"""MTP speculative decoding on glm5_nano through the real serving path (issue #15).

For each configuration it starts nq-streamer, nq-worker (--speculative_tokens N) and nq-router
on loopback, streams greedy /v1/completions for prompts cut from the model's held-out text
(models/glm5_nano/eval/*.txt), and reports:
  - decode tokens/s: per request (completion_tokens - 1) / (time of the last token - time of
    the first), summed over requests (prefill excluded);
  - from the worker's /metrics: acceptance of draft position k (accepted_per_pos{k} / drafts)
    and mean tokens per verification step (1 + accepted / drafts).

Usage (after building nq-router, nq-worker, nq-streamer and nq in build/cpu):
  python3 bench/spec_decode/run_spec_bench.py [--model DIR] [--requests 16] [--max_tokens 64]
      [--configs full:0,full:1,full:2,full:3,4bit:3,2bit:3,live:3]
Experts: full = the checkpoint's (bf16), 4bit / 2bit = the release at a static width, live =
the release streamed (2-bit base, 4 bits from READY slots). The model directory must hold the
release (scripts/embedded_model.sh writes both).
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "build/cpu/services")
DOMAINS = ["stdlib_code", "libs_code", "docstrings", "stdlib_tests"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def held_out_prompts(count, chars=400):
    """`count` prompts, alternating domains, each ending at a line break so the model continues code."""
    texts = [open(os.path.join(ROOT, "models/glm5_nano/eval", d + ".txt"), encoding="utf-8").read() for d in DOMAINS]
    prompts = []
    for i in range(count):
        text = texts[i % len(texts)]
        start = (i // len(texts)) * 2 * chars + 137 * i
        start = text.find("\n", start % (len(text) - 2 * chars)) + 1
        end = text.rfind("\n", start, start + chars) + 1
        prompts.append(text[start:end if end > start else start + chars])
    return prompts


def metrics(port):
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith("nq_spec_decode_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_health(port, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("a service exited during startup")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return
        except Exception:
            time.sleep(0.2)
    raise RuntimeError("the router did not become healthy")


def stream_completion(port, prompt, max_tokens):
    """Streams one greedy completion; returns (tokens, seconds from first to last token)."""
    body = json.dumps({"model": "embedded", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    first = last = None
    tokens = 0
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                now = time.perf_counter()
                first = first or now
                last = now
    return tokens, (last - first) if first and last else 0.0


def run_config(model, experts, n, prompts, max_tokens, log_dir):
    ports = {k: free_port() for k in ["sg", "sh", "wg", "wh", "rg", "rh"]}
    worker_flags = [f"--speculative_tokens={n}", "--max_model_len=1024"]
    if experts in ("4bit", "2bit"):
        worker_flags += [f"--release={model}/release", f"--expert_bits={experts[0]}"]
    elif experts == "live":
        worker_flags += [f"--release={model}/release"]
    streamer_flags = [f"--records_dir={model}/release"] if experts == "live" else []
    procs = []
    try:
        def start(name, argv):
            log = open(os.path.join(log_dir, f"{experts}_{n}_{name}.log"), "w")
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
        start("streamer", [f"{BIN}/streamer/nq-streamer", "--host=127.0.0.1", f"--grpc_port={ports['sg']}",
                           f"--metrics_port={ports['sh']}"] + streamer_flags)
        start("worker", [f"{BIN}/worker/nq-worker", "--host=127.0.0.1", f"--grpc_port={ports['wg']}",
                         f"--metrics_port={ports['wh']}", f"--streamer_address=127.0.0.1:{ports['sg']}",
                         f"--model={model}", "--served_model_name=embedded"] + worker_flags)
        start("router", [f"{BIN}/router/nq-router", "--host=127.0.0.1", f"--grpc_port={ports['rg']}",
                         f"--http_port={ports['rh']}", f"--worker_address=127.0.0.1:{ports['wg']}",
                         f"--tokenizer={model}/tokenizer.json"])
        wait_health(ports["rh"], procs[-1])
        stream_completion(ports["rh"], "def warmup():\n", 4)  # first-request costs out of the figures
        before = metrics(ports["wh"])
        total_tokens, total_seconds = 0, 0.0
        for p in prompts:
            tokens, seconds = stream_completion(ports["rh"], p, max_tokens)
            total_tokens += max(tokens - 1, 0)
            total_seconds += seconds
        after = metrics(ports["wh"])
        delta = {k: after[k] - before.get(k, 0.0) for k in after}
        return total_tokens / total_seconds if total_seconds > 0 else 0.0, delta
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "build/cpu/embedded-model"))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--configs", default="full:0,full:1,full:2,full:3,4bit:3,2bit:3,live:3")
    ap.add_argument("--log_dir", default="/tmp/nq_spec_bench")
    a = ap.parse_args()
    os.makedirs(a.log_dir, exist_ok=True)
    prompts = held_out_prompts(a.requests)
    print("| experts | N | decode tokens/s | tokens / step | acceptance by draft position | accepted / drafted |")
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    for config in a.configs.split(","):
        experts, n = config.split(":")
        n = int(n)
        rate, m = run_config(a.model, experts, n, prompts, a.max_tokens, a.log_dir)
        steps = m.get("nq_spec_decode_num_drafts_total", 0)
        if n > 0 and steps > 0:
            accepted = m["nq_spec_decode_num_accepted_tokens_total"]
            drafted = m["nq_spec_decode_num_draft_tokens_total"]
            per_pos = [m.get(f'nq_spec_decode_num_accepted_tokens_per_pos_total{{position="{k}"}}', 0) / steps
                       for k in range(n)]
            print(f"| {experts} | {n} | {rate:.1f} | {1 + accepted / steps:.2f} | "
                  f"{' / '.join(f'{x:.3f}' for x in per_pos)} | {accepted / drafted:.3f} |", flush=True)
        else:
            print(f"| {experts} | {n} | {rate:.1f} | 1.00 | - | - |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
