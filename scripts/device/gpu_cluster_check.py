#!/usr/bin/env python3
"""The whole cluster on one machine, checked end to end (issue #14; run by run_gpu_cluster.sh).

Starts the three real binaries (nq-streamer, nq-worker, nq-router) on loopback and checks, each
result into a JSON report:
  greedy       64 greedy tokens of the worker under test equal those of a CPU worker, at 2 bits,
               4 bits and the release's fixed set (static bits, no drafts: deterministic)
  streaming    a chat completion streamed through the OpenAI API by a worker whose residuals the
               streamer writes into its slots (dynamic bits), with loads and 4-bit calls counted
  bench, http  decode tokens/s through the HTTP stream next to `nq bench-decode` on the same model,
               bits and backend (and the worker's own step time); streaming also times a request
               while residual reads run against the same request once the slots have settled
  streamer_kill  the streamer is killed mid-generation: the stream finishes without an error, and
               a restarted streamer adopts the worker's READY slots
  worker_kill  the worker is killed: the router answers 503 (not a hang), and serves again once a
               new worker is up
  spec         MTP speculative decoding with N = 0..3 drafts: tokens/s, step time, acceptance per
               position, and greedy output identical to N = 0's
  bf16, fp8    weight matrices stored as BF16 / FP8 (128x128 block scales): greedy tokens against
               the reference backend's (same storage), bench-decode tokens/s against F32 storage
  stress       requests over varied prompts with --verify_slots: every slot announced READY is
               compared with its record in the release, and READY slots are re-hashed after every
               step (nq_worker_slot_integrity_failures_total must stay 0)
Python's standard library only (the GPU machine has no extra packages for it).

  gpu_cluster_check.py --bin DIR --model DIR --out DIR [--backend cuda] [--reference-backend cpu]
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_files(path):",
    "class Stack:\n    def __init__(self):",
    "def parse_args(argv):\n    \"\"\"Parse the command line.\"\"\"",
    "for i in range(10):\n",
    "def merge_sort(items):",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, body=None, timeout=60.0):
    """(status, parsed JSON or text); status 0 when the connection failed."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as error:
        text, status = error.read().decode(errors="replace"), error.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, socket.timeout) as error:
        return 0, str(error)
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def metrics(port):
    """Samples of a /metrics page: {'name{labels}': value}."""
    status, text = http("GET", f"http://127.0.0.1:{port}/metrics", timeout=10)
    samples = {}
    if status != 200 or not isinstance(text, str):
        return samples
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                samples[key] = float(value)
            except ValueError:
                pass
    return samples


def stream_chat(port, body, on_chunk=None, timeout=300.0):
    """Streams a chat completion. Returns (chunk arrival times, text, finish_reason, usage, error)."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    times, text, finish, usage, error = [], "", None, None, None
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    error = event["error"]
                    continue
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices", []):
                    delta = choice.get("delta", {}).get("content") or ""
                    if delta:
                        times.append(time.monotonic())
                        text += delta
                        if on_chunk:
                            on_chunk(len(times))
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
    except Exception as exc:  # the check records any failure of the stream itself
        error = f"{type(exc).__name__}: {exc}"
    return times, text, finish, usage, error


class Cluster:
    """The three services on fresh loopback ports; logs under `log_dir`."""

    def __init__(self, bin_dir, model_dir, log_dir, name):
        self.bin, self.model, self.name = bin_dir, model_dir, name
        self.log_dir = os.path.join(log_dir, name)
        os.makedirs(self.log_dir, exist_ok=True)
        self.ports = {k: free_port() for k in ("s_grpc", "s_metrics", "w_grpc", "w_metrics", "r_http", "r_grpc")}
        self.procs = {}
        self.worker_flags = []

    def _spawn(self, service, args):
        log = open(os.path.join(self.log_dir, f"{service}.log"), "a")
        log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(args)}\n")
        log.flush()
        self.procs[service] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def start_streamer(self):
        self._spawn("streamer", [f"{self.bin}/nq-streamer", "--host=127.0.0.1", f"--grpc_port={self.ports['s_grpc']}",
                                 f"--metrics_port={self.ports['s_metrics']}",
                                 f"--records_dir={self.model}/release"])

    def start_worker(self, flags=None):
        if flags is not None:
            self.worker_flags = flags
        self._spawn("worker", [f"{self.bin}/nq-worker", "--host=127.0.0.1", f"--grpc_port={self.ports['w_grpc']}",
                               f"--metrics_port={self.ports['w_metrics']}",
                               f"--streamer_address=127.0.0.1:{self.ports['s_grpc']}", f"--model={self.model}",
                               f"--release={self.model}/release", "--served_model_name=embedded"] + self.worker_flags)

    def start_router(self):
        self._spawn("router", [f"{self.bin}/nq-router", "--host=127.0.0.1", f"--http_port={self.ports['r_http']}",
                               f"--grpc_port={self.ports['r_grpc']}",
                               f"--worker_address=127.0.0.1:{self.ports['w_grpc']}",
                               f"--tokenizer={self.model}/tokenizer.json", "--chat_format=plain",
                               "--worker_poll_interval_s=0.2"])

    def start(self, worker_flags, timeout=120):
        self.start_streamer()
        self.start_worker(worker_flags)
        self.start_router()
        self.wait_ready(timeout)

    def wait_ready(self, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for service, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{self.name}: {service} exited with {proc.returncode}; see "
                                       f"{self.log_dir}/{service}.log:\n{self.tail(service)}")
            status, _ = http("GET", f"http://127.0.0.1:{self.ports['r_http']}/health", timeout=2)
            if status == 200:
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name}: not healthy in {timeout} s:\n{self.tail('worker')}")

    def kill(self, service):
        proc = self.procs[service]
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop(self):
        for service in ("router", "worker", "streamer"):
            proc = self.procs.get(service)
            if proc and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def tail(self, service, lines=30):
        try:
            with open(os.path.join(self.log_dir, f"{service}.log")) as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def log_size(self, service):
        try:
            return os.path.getsize(os.path.join(self.log_dir, f"{service}.log"))
        except OSError:
            return 0

    def log_since(self, service, offset):
        with open(os.path.join(self.log_dir, f"{service}.log"), errors="replace") as f:
            f.seek(offset)
            return f.read()

    def completion(self, prompt, max_tokens, timeout=300, logprobs=None):
        body = {"model": "embedded", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        if logprobs is not None:
            body["logprobs"] = logprobs
        return http("POST", f"http://127.0.0.1:{self.ports['r_http']}/v1/completions", body, timeout=timeout)

    def chat_body(self, prompt, max_tokens):
        return {"model": "embedded", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}


def decode_rate(times, usage):
    """Decode tokens/s between the first and the last streamed chunk."""
    if not usage or len(times) < 2 or times[-1] <= times[0]:
        return None
    return (usage["completion_tokens"] - 1) / (times[-1] - times[0])


def first_divergence(reference, tested):
    """Where two greedy runs part: the token index, and the reference's top-2 log-probability
    margin there (a margin near 0 is a near-tie that fp16 vs fp32 arithmetic may break either
    way; a large one is a real numerical difference)."""
    ref_tokens, test_tokens = reference["tokens"], tested["tokens"]
    for i, (a, b) in enumerate(zip(ref_tokens, test_tokens)):
        if a != b:
            top = sorted(reference["top_logprobs"][i].values(), reverse=True)
            margin = top[0] - top[1] if len(top) > 1 else None
            tested_top = sorted(tested["top_logprobs"][i].values(), reverse=True)
            tested_margin = tested_top[0] - tested_top[1] if len(tested_top) > 1 else None
            return {"token": i, "reference": a, "tested": b, "reference_margin": margin,
                    "tested_margin": tested_margin}
    return None


def check_greedy(args, report):
    """Greedy tokens of the backend under test against a CPU worker, static bits, no drafts."""
    results = {}
    for bits in ("2", "4", "fixed"):
        texts, logprobs = {}, {}
        for backend in (args.reference_backend, args.backend):
            cluster = Cluster(args.bin, args.model, args.logs, f"greedy-{bits}-{backend}")
            try:
                extra = args.test_worker_flags.split() if backend == args.backend else []
                cluster.start([f"--backend={backend}", f"--expert_bits={bits}", "--speculative_tokens=0"] + extra)
                outputs, lps = [], []
                for prompt in PROMPTS[:3]:
                    status, body = cluster.completion(prompt, args.greedy_tokens, logprobs=2)
                    ok = status == 200 and body["usage"]["completion_tokens"] == args.greedy_tokens
                    outputs.append(body["choices"][0]["text"] if ok else f"HTTP {status}: {body}")
                    lps.append(body["choices"][0].get("logprobs") if ok else None)
                texts[backend], logprobs[backend] = outputs, lps
            finally:
                cluster.stop()
        same = [a == b for a, b in zip(texts[args.reference_backend], texts[args.backend])]
        divergence = [None if equal or ref is None or test is None else first_divergence(ref, test)
                      for equal, ref, test in zip(same, logprobs[args.reference_backend], logprobs[args.backend])]
        results[bits] = {"equal": all(same), "per_prompt_equal": same, "first_divergence": divergence,
                         args.backend: texts[args.backend], args.reference_backend: texts[args.reference_backend]}
    report["greedy"] = {"pass": all(r["equal"] for r in results.values()), "by_bits": results}


def check_http_speed(args, report):
    """Decode tokens/s through the HTTP stream of a worker with static bits and no drafts (what
    `nq bench-decode` measures without the services), and where a token's time goes: the
    worker's own decode steps (its histogram) against the gaps the client sees."""
    cluster = Cluster(args.bin, args.model, args.logs, "http-speed")
    try:
        cluster.start([f"--backend={args.backend}", "--expert_bits=fixed", "--speculative_tokens=0"])
        # A warm-up request (first-use costs: lazy module loading, allocations).
        stream_chat(cluster.ports["r_http"], cluster.chat_body(PROMPTS[0], 16))
        before = metrics(cluster.ports["w_metrics"])
        times, _, _, usage, error = stream_chat(cluster.ports["r_http"],
                                                cluster.chat_body(PROMPTS[0], args.decode_tokens))
        after = metrics(cluster.ports["w_metrics"])
        report["speed"]["http_tokens_per_s_fixed"] = decode_rate(times, usage)
        report["speed"]["http_stream_error"] = error
        key = 'nq_worker_step_seconds_{}{{phase="decode"}}'
        steps = after.get(key.format("count"), 0) - before.get(key.format("count"), 0)
        if steps > 0:
            step_s = (after[key.format("sum")] - before.get(key.format("sum"), 0)) / steps
            report["speed"]["worker_decode_step_ms_mean"] = step_s * 1e3
            if len(times) > 1:
                report["speed"]["client_gap_ms_mean"] = (times[-1] - times[0]) / (len(times) - 1) * 1e3
    finally:
        cluster.stop()
    bench = report["speed"].get("bench_decode_tokens_per_s_fixed")
    if bench and report["speed"]["http_tokens_per_s_fixed"]:
        report["speed"]["http_over_bench_decode"] = report["speed"]["http_tokens_per_s_fixed"] / bench


def check_bench_decode(args, report):
    out = os.path.join(args.out, "bench_decode_fixed.json")
    command = [f"{args.bin}/nq", "bench-decode", f"--model={args.model}", f"--release={args.model}/release",
               "--expert-bits=fixed", f"--backend={args.backend}", f"--decode-tokens={args.decode_tokens}",
               "--warmup=8", "--prompt-tokens=16", f"--out={out}"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    report["speed"]["bench_decode_command"] = " ".join(command)
    if run.returncode != 0:
        report["speed"]["bench_decode_error"] = run.stderr[-2000:]
        return
    with open(out) as f:
        bench = json.load(f)
    report["speed"]["bench_decode_tokens_per_s_fixed"] = bench["tokens_per_second"]
    report["speed"]["bench_decode_step_ms_p50"] = bench["ms_per_token_p50"]


def check_streaming_and_kills(args, report):
    cluster = Cluster(args.bin, args.model, args.logs, "dynamic")
    try:
        cluster.start([f"--backend={args.backend}", "--expert_bits=dynamic"])
        worker_port, streamer_port, http_port = cluster.ports["w_metrics"], cluster.ports["s_metrics"], cluster.ports["r_http"]

        # Streamed chat with residual reads running (a fresh worker: the predictor is placing experts).
        before = metrics(streamer_port)
        times, text, finish, usage, error = stream_chat(http_port, cluster.chat_body(PROMPTS[1], args.decode_tokens))
        during = metrics(streamer_port)
        # The same request again once the slots have settled (few reads).
        times2, _, _, usage2, error2 = stream_chat(http_port, cluster.chat_body(PROMPTS[1], args.decode_tokens))
        after = metrics(streamer_port)
        worker = metrics(worker_port)
        read = lambda m: m.get("nq_streamer_read_bytes_total", 0.0)
        ready = lambda m: m.get('nq_streamer_slot_loads_total{result="ready"}', 0.0)
        report["streaming"] = {
            "pass": error is None and finish == "length" and usage is not None
                    and usage["completion_tokens"] == args.decode_tokens and ready(during) > 0
                    and worker.get('nq_expert_calls_total{bits="4"}', 0) > 0,
            "error": error, "finish_reason": finish, "usage": usage, "text_head": text[:200],
            "loads_ready": ready(after), "loads_failed": after.get('nq_streamer_slot_loads_total{result="failed"}'),
            "expert_calls_4bit": worker.get('nq_expert_calls_total{bits="4"}'),
            "expert_calls_2bit": worker.get('nq_expert_calls_total{bits="2"}'),
            "gpu_memory_bytes": {k: v for k, v in worker.items() if k.startswith("nq_worker_gpu_memory_bytes")},
            "routed_expert_bytes": {k: v for k, v in worker.items() if k.startswith("nq_worker_routed_expert_bytes")},
            "kv_cache_bytes": worker.get("nq_worker_kv_cache_bytes"),
        }
        report["speed"]["dynamic_first_request"] = {"tokens_per_s": decode_rate(times, usage),
                                                    "record_bytes_read": read(during) - read(before)}
        report["speed"]["dynamic_repeat_request"] = {"tokens_per_s": decode_rate(times2, usage2),
                                                     "record_bytes_read": read(after) - read(during), "error": error2}

        # Kill the streamer mid-generation; the stream must finish (experts fall back to 2 bits).
        killed_at = {}

        def kill_after(n):
            if n == 24 and "t" not in killed_at:
                killed_at["t"] = time.monotonic()
                cluster.kill("streamer")

        times, text, finish, usage, error = stream_chat(http_port, cluster.chat_body(PROMPTS[2], 160), kill_after)
        after_kill = metrics(worker_port)
        log_offset = cluster.log_size("streamer")
        cluster.start_streamer()
        adopted, deadline = None, time.monotonic() + 60
        while time.monotonic() < deadline and adopted is None:
            match = re.findall(r"(\d+) READY slots adopted", cluster.log_since("streamer", log_offset))
            if match:
                adopted = int(match[-1])
            time.sleep(0.5)
        status, body = cluster.completion(PROMPTS[3], 32)
        report["streamer_kill"] = {
            "pass": "t" in killed_at and error is None and finish == "length" and usage is not None
                    and usage["completion_tokens"] == 160 and adopted is not None and adopted > 0 and status == 200,
            "killed_after_chunks": 24 if "t" in killed_at else None, "stream_error": error, "finish_reason": finish,
            "completion_tokens": usage and usage["completion_tokens"],
            "worker_streamer_connected_after_kill": after_kill.get("nq_worker_streamer_connected"),
            "ready_slots_adopted_by_the_new_streamer": adopted, "request_after_restart_status": status,
        }

        # Kill the worker: 503 from the router, not a hang; serving again once it is back.
        cluster.kill("worker")
        time.sleep(0.5)
        started = time.monotonic()
        status, body = cluster.completion(PROMPTS[0], 8, timeout=60)
        answer_seconds = time.monotonic() - started
        cluster.start_worker()
        recovered, deadline = None, time.monotonic() + 180
        while time.monotonic() < deadline:
            status2, _ = cluster.completion(PROMPTS[0], 8, timeout=30)
            if status2 == 200:
                recovered = time.monotonic() - started
                break
            time.sleep(0.5)
        report["worker_kill"] = {"pass": status == 503 and answer_seconds < 10 and recovered is not None,
                                 "status_while_down": status, "answer_seconds": answer_seconds,
                                 "body_while_down": body if isinstance(body, (dict, str)) else None,
                                 "seconds_until_serving_again": recovered}
    finally:
        cluster.stop()


def draft_buckets(before, after):
    """{bound in ms: drafting steps at or under it} between two /metrics samples (cumulative)."""
    out = {}
    for key, value in after.items():
        if key.startswith("nq_worker_step_seconds_bucket{") and 'phase="draft"' in key and 'le="' in key:
            le = key.split('le="', 1)[1].split('"', 1)[0]
            bound = "+Inf" if le == "+Inf" else f"{float(le) * 1e3:g}"
            out[bound] = value - before.get(key, 0.0)
    return out


def check_spec(args, report):
    """MTP speculative decoding on the backend under test (issue #15): for N = 0..3 drafts, a
    256-token streamed request's tokens/s, the worker's mean step (drafting + the 1 + N
    verification forward + sampling), tokens per step and acceptance per position, and greedy
    output identical to N = 0's (batch-invariant verification)."""
    rows, base = {}, None
    for n in args.spec_drafts:
        cluster = Cluster(args.bin, args.model, args.logs, f"spec-{n}")
        try:
            cluster.start([f"--backend={args.backend}", "--expert_bits=fixed", f"--speculative_tokens={n}"] +
                          args.spec_worker_flags.split())
            # Warm-up: a fresh worker captures one step graph per (rows, drafts, context bucket) on
            # first use, each costing a step op by op and a capture; --spec-warmup-tokens long enough
            # to meet the kept-row counts 1 to N + 1 measures the steady state, 16 the first request.
            # Its prompt is every prompt joined, longer than the measured one: a prefill longer than
            # any before grows the backend's workspaces, which captures every graph again.
            stream_chat(cluster.ports["r_http"], cluster.chat_body("\n\n".join(PROMPTS), args.spec_warmup_tokens))
            before = metrics(cluster.ports["w_metrics"])
            times, _, _, usage, error = stream_chat(cluster.ports["r_http"],
                                                    cluster.chat_body(PROMPTS[4], args.decode_tokens))
            after = metrics(cluster.ports["w_metrics"])
            delta = lambda key: after.get(key, 0.0) - before.get(key, 0.0)
            steps = delta('nq_worker_step_seconds_count{phase="decode"}')
            texts = []
            for prompt in PROMPTS[:3]:
                status, body = cluster.completion(prompt, args.greedy_tokens)
                texts.append(body["choices"][0]["text"] if status == 200 else f"HTTP {status}: {json.dumps(body)[:300]}")
            drafts = delta("nq_spec_decode_num_draft_tokens_total")
            rows[n] = {
                "tokens_per_s": decode_rate(times, usage), "error": error,
                "decode_steps": steps,
                "step_ms_mean": delta('nq_worker_step_seconds_sum{phase="decode"}') / steps * 1e3 if steps else None,
                # Of a step, the drafter's part (the worker's phase="draft"), per step that drafted.
                "draft_ms_mean": (delta('nq_worker_step_seconds_sum{phase="draft"}') /
                                  delta('nq_worker_step_seconds_count{phase="draft"}') * 1e3
                                  if delta('nq_worker_step_seconds_count{phase="draft"}') else None),
                # The drafting phase's histogram over this request: steps at or under each bound (ms),
                # so a mean pulled up by a few slow steps (a new graph's warm-up and capture) shows.
                "draft_steps_at_most_ms": draft_buckets(before, after),
                # The worker's step graphs over this request: a warmup and a capture per new key.
                "step_graph_events": {e: delta(f'nq_worker_step_graphs_total{{event="{e}"}}')
                                      for e in ("warmup", "capture", "replay")},
                # 1 once a failed capture turned the worker's graphs off (every step op by op since).
                "step_graphs_off": after.get("nq_worker_step_graphs_off"),
                "tokens_per_step": (usage["completion_tokens"] - 1) / steps if steps and usage else None,
                "acceptance": delta("nq_spec_decode_num_accepted_tokens_total") / drafts if drafts else None,
                "accepted_per_position": [
                    delta(f'nq_spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}') /
                    max(1.0, delta("nq_spec_decode_num_drafts_total")) for i in range(n)],
                "greedy_texts": texts,
            }
            if base is None:
                base = texts
            rows[n]["greedy_equal_to_first"] = texts == base
        finally:
            cluster.stop()
    first, last = args.spec_drafts[0], args.spec_drafts[-1]
    summary = {"pass": all(r["greedy_equal_to_first"] and r["error"] is None for r in rows.values()), "by_drafts": rows}
    if rows[first]["tokens_per_s"] and rows[last]["tokens_per_s"]:
        summary[f"speedup_{last}_over_{first}"] = rows[last]["tokens_per_s"] / rows[first]["tokens_per_s"]
    if rows[first]["step_ms_mean"] and rows[last]["step_ms_mean"]:
        summary[f"step_time_{last}_over_{first}"] = rows[last]["step_ms_mean"] / rows[first]["step_ms_mean"]
    report["spec"] = summary


def check_weight_dtype(args, report, dtype):
    """Weight matrices stored as BF16 or FP8 (--weight_dtype bf16|fp8): the backend under test's
    greedy tokens against the reference backend's with the same storage, and bench-decode's
    tokens/s against F32 storage (the F32 figure from the bench check)."""
    texts = {}
    for backend in (args.reference_backend, args.backend):
        cluster = Cluster(args.bin, args.model, args.logs, f"{dtype}-{backend}")
        try:
            cluster.start([f"--backend={backend}", "--expert_bits=fixed", "--speculative_tokens=0",
                           f"--weight_dtype={dtype}"])
            outputs = []
            for prompt in PROMPTS[:3]:
                status, body = cluster.completion(prompt, args.greedy_tokens)
                outputs.append(body["choices"][0]["text"] if status == 200 else f"HTTP {status}: {body}")
            texts[backend] = outputs
        finally:
            cluster.stop()
    out = os.path.join(args.out, f"bench_decode_fixed_{dtype}.json")
    run = subprocess.run([f"{args.bin}/nq", "bench-decode", f"--model={args.model}", f"--release={args.model}/release",
                          "--expert-bits=fixed", f"--backend={args.backend}", f"--decode-tokens={args.decode_tokens}",
                          "--warmup=8", "--prompt-tokens=16", f"--weight-dtype={dtype}", f"--out={out}"],
                         capture_output=True, text=True, timeout=600)
    result = {"greedy_equal": texts[args.reference_backend] == texts[args.backend], "texts": texts}
    if run.returncode == 0:
        with open(out) as f:
            bench = json.load(f)
        result["bench_decode_tokens_per_s"] = bench["tokens_per_second"]
        result["bench_decode_step_ms_p50"] = bench["ms_per_token_p50"]
        f32 = report["speed"].get("bench_decode_tokens_per_s_fixed")
        if f32:
            result["over_f32"] = bench["tokens_per_second"] / f32
    else:
        result["bench_decode_error"] = run.stderr[-2000:]
    result["pass"] = result["greedy_equal"] and run.returncode == 0
    report[dtype] = result


def check_stress(args, report):
    """Loads and evictions over varied prompts with every READY slot checked against its record."""
    cluster = Cluster(args.bin, args.model, args.logs, "stress")
    try:
        cluster.start([f"--backend={args.backend}", "--expert_bits=dynamic", "--verify_slots"])
        errors = []
        for round_ in range(args.stress_rounds):
            for prompt in PROMPTS:
                status, body = cluster.completion(prompt + "\n" * (round_ % 3), 48)
                if status != 200:
                    errors.append(f"HTTP {status}: {body}")
        worker = metrics(cluster.ports["w_metrics"])
        streamer = metrics(cluster.ports["s_metrics"])
        failures = worker.get("nq_worker_slot_integrity_failures_total")
        report["stress"] = {
            "pass": not errors and failures == 0 and streamer.get("nq_streamer_slot_unmaps_total", 0) > 0,
            "requests": args.stress_rounds * len(PROMPTS), "errors": errors[:5],
            "integrity_failures": failures,
            "loads_ready": streamer.get('nq_streamer_slot_loads_total{result="ready"}'),
            "unmaps": streamer.get("nq_streamer_slot_unmaps_total"),
            "updates_applied": worker.get("nq_worker_slot_updates_applied_total"),
        }
    finally:
        cluster.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--reference-backend", default="cpu")
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--stress-rounds", type=int, default=4)
    parser.add_argument("--only", default="greedy,bench,http,streaming,spec,bf16,fp8,stress")
    parser.add_argument("--greedy-tokens", type=int, default=64)
    # e.g. "--step_graphs=false": the worker under test with a feature off (greedy check only).
    parser.add_argument("--test-worker-flags", default="")
    parser.add_argument("--spec-drafts", default="0,1,2,3", type=lambda v: [int(x) for x in v.split(",")])
    # e.g. "--device_sampling=false": the spec check's workers with a feature off (every N).
    parser.add_argument("--spec-worker-flags", default="")
    parser.add_argument("--spec-warmup-tokens", type=int, default=16,
                        help="spec: tokens of the warm-up request before the measured one (16: a first request; "
                             "256: about the steady state, every kept-row count's graph captured)")
    args = parser.parse_args()
    args.logs = os.path.join(args.out, "logs")
    os.makedirs(args.logs, exist_ok=True)
    report = {"backend": args.backend, "reference_backend": args.reference_backend, "speed": {}}
    checks = {"greedy": check_greedy, "bench": check_bench_decode, "http": check_http_speed,
              "streaming": check_streaming_and_kills, "spec": check_spec,
              "bf16": lambda a, r: check_weight_dtype(a, r, "bf16"),
              "fp8": lambda a, r: check_weight_dtype(a, r, "fp8"), "stress": check_stress}
    for name in args.only.split(","):
        started = time.monotonic()
        try:
            checks[name](args, report)
        except Exception as exc:  # one failed check must not hide the others' results
            report.setdefault("exceptions", {})[name] = f"{type(exc).__name__}: {exc}"
        report.setdefault("seconds", {})[name] = round(time.monotonic() - started, 1)
        with open(os.path.join(args.out, "gpu_cluster.json"), "w") as f:
            json.dump(report, f, indent=2)
    verdicts = {k: v["pass"] for k, v in report.items() if isinstance(v, dict) and "pass" in v}
    summary = {"verdicts": verdicts, "speed": report["speed"], "exceptions": report.get("exceptions")}
    if "spec" in report:  # compact: the full rows are in gpu_cluster.json
        summary["spec"] = {k: v for k, v in report["spec"].items() if k != "by_drafts"}
        summary["spec"]["by_drafts"] = {
            n: {k: row[k] for k in ("tokens_per_s", "step_ms_mean", "tokens_per_step", "accepted_per_position")}
            for n, row in report["spec"]["by_drafts"].items()}
    print(json.dumps(summary, indent=2))
    return 0 if verdicts and all(verdicts.values()) and not report.get("exceptions") else 1


if __name__ == "__main__":
    raise SystemExit(main())
