"""Pure-Python reference of the learned predictor jF (issue #21): routing traces, the
features, the model's forward and its safetensors file. No numpy, no torch: it runs on the
development VM (for test fixtures) and on the GPU machine (train_jf.py builds its data set
with it, so training sees exactly the features the streamer computes).

Mirrors, and must change together with:
  services/streamer/routing_trace.{h,cc}  trace files (versions 1 and 2)
  services/streamer/jf_features.{h,cc}    the 16 features (kJfFeatureSet)
  services/streamer/jf_model.{h,cc}       the forward and the file's tensors and metadata
"""
import gzip
import json
import math
import struct

FEATURE_SET = "jf-features-1"
NUM_FEATURES = 16
HALF_LIVES = (8, 32, 128, 512, 2048)
WINDOW = 16
MAX_AGE = 2048
AGE_SCALE = 11.0
POSITION_SCALE = 16.0
HORIZON = 64
TENSOR_ORDER = ("emb", "w_in", "b_in", "query", "w_ctx", "w_h", "b_h", "w_out", "b_out")


# ---------------------------------------------------------------- traces

class Trace:
    """experts[t][l] and weights[t][l]: top_k lists; norms[t][l] or None; sequences: [(b, e)]."""

    def __init__(self, layer_ids, experts_per_layer, top_k):
        self.layer_ids = list(layer_ids)
        self.experts_per_layer = experts_per_layer
        self.top_k = top_k
        self.experts = []
        self.weights = []
        self.norms = None
        self.sequence_starts = []

    @property
    def num_layers(self):
        return len(self.layer_ids)

    @property
    def num_tokens(self):
        return len(self.experts)

    def sequences(self):
        starts = self.sequence_starts or [0]
        ends = list(starts[1:]) + [self.num_tokens]
        return [(b, e) for b, e in zip(starts, ends) if e > b]


def read_trace(path):
    """A trace file, gzipped or not (the committed ones are .nqrt.gz)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    if data[:4] != b"NQRT":
        raise ValueError(f"{path}: not a routing trace")
    version, layers, experts, top_k, tokens = struct.unpack_from("<IIIIQ", data, 4)
    pos = 4 + 24
    has_norms = False
    starts = []
    if version == 2:
        flags, nseq = struct.unpack_from("<IQ", data, pos)
        pos += 12
        has_norms = bool(flags & 1)
        starts = list(struct.unpack_from(f"<{nseq}Q", data, pos))
        pos += 8 * nseq
    elif version != 1:
        raise ValueError(f"{path}: trace version {version}")
    trace = Trace(struct.unpack_from(f"<{layers}I", data, pos), experts, top_k)
    pos += 4 * layers
    trace.sequence_starts = starts
    trace.norms = [] if has_norms else None
    ids_fmt, w_fmt = f"<{top_k}H", f"<{top_k}f"
    for _ in range(tokens):
        tok_e, tok_w, tok_n = [], [], []
        for _ in range(layers):
            tok_e.append(list(struct.unpack_from(ids_fmt, data, pos)))
            pos += 2 * top_k
            tok_w.append(list(struct.unpack_from(w_fmt, data, pos)))
            pos += 4 * top_k
            if has_norms:
                tok_n.append(struct.unpack_from("<f", data, pos)[0])
                pos += 4
        trace.experts.append(tok_e)
        trace.weights.append(tok_w)
        if has_norms:
            trace.norms.append(tok_n)
    if pos != len(data):
        raise ValueError(f"{path}: {len(data) - pos} trailing bytes")
    return trace


def write_trace(trace, path):
    out = bytearray(b"NQRT")
    out += struct.pack("<IIIIQ", 2, trace.num_layers, trace.experts_per_layer, trace.top_k,
                       trace.num_tokens)
    out += struct.pack("<IQ", 1 if trace.norms is not None else 0, len(trace.sequence_starts))
    out += struct.pack(f"<{len(trace.sequence_starts)}Q", *trace.sequence_starts)
    out += struct.pack(f"<{trace.num_layers}I", *trace.layer_ids)
    for t in range(trace.num_tokens):
        for l in range(trace.num_layers):
            out += struct.pack(f"<{trace.top_k}H", *trace.experts[t][l])
            out += struct.pack(f"<{trace.top_k}f", *trace.weights[t][l])
            if trace.norms is not None:
                out += struct.pack("<f", trace.norms[t][l])
    with open(path, "wb") as f:
        f.write(out)


# ---------------------------------------------------------------- features

class Features:
    """jf_features.h's JfFeatureState, with exact (lazy) EMA decay in double precision."""

    def __init__(self, layers, experts, top_k):
        self.layers, self.experts, self.top_k = layers, experts, top_k
        self.decay = [2.0 ** (-1.0 / h) for h in HALF_LIVES]
        cells = layers * experts
        self.hit = [[0.0] * len(HALF_LIVES) for _ in range(cells)]
        self.sal = [[0.0] * len(HALF_LIVES) for _ in range(cells)]
        self.stamp = [0] * cells  # global token count at the cell's last EMA update
        self.now = 0              # global tokens observed
        self.position = 0
        self.last_hit = [0] * cells
        self.seq_hits = [0] * cells
        self.ring = [None] * WINDOW  # per token: [(layer, expert, salience)]

    def _bring(self, cell):
        dt = self.now - self.stamp[cell]
        if dt:
            for h, g in enumerate(self.decay):
                f = g ** dt
                self.hit[cell][h] *= f
                self.sal[cell][h] *= f
            self.stamp[cell] = self.now

    def observe(self, experts, weights, norms):
        """experts/weights: [layer][j]; norms: [layer] or None."""
        self.now += 1
        entries = []
        for l in range(self.layers):
            n = norms[l] if norms is not None and norms[l] > 0 and math.isfinite(norms[l]) else 1.0
            for e, w in zip(experts[l], weights[l]):
                w = w if math.isfinite(w) else 0.0
                # float32 like the C++ (w * w * n in float).
                salience = f32(f32(f32(w) * f32(w)) * f32(n))
                cell = l * self.experts + e
                self._bring(cell)
                for h, g in enumerate(self.decay):
                    self.hit[cell][h] += 1.0 - g
                    self.sal[cell][h] += (1.0 - g) * salience
                self.last_hit[cell] = self.position + 1
                self.seq_hits[cell] += 1
                entries.append((l, e, salience))
        self.ring[self.position % WINDOW] = entries
        self.position += 1

    def new_sequence(self):
        self.position = 0
        self.last_hit = [0] * len(self.last_hit)
        self.seq_hits = [0] * len(self.seq_hits)

    def fill(self, layer, resident):
        """[experts][16] for `layer`; resident: list of 0/1 per expert."""
        E, k = self.experts, self.top_k
        rate = E / k
        win_hits = [0.0] * E
        win_sal = [0.0] * E
        for back in range(1, min(self.position, WINDOW) + 1):
            for (l, e, s) in self.ring[(self.position - back) % WINDOW]:
                if l == layer:
                    win_hits[e] += 1.0
                    win_sal[e] += s
        win_sum = sum(win_sal)
        for e in range(E):
            self._bring(layer * E + e)
        sal_sum = [sum(self.sal[layer * E + e][h] for e in range(E)) for h in range(len(HALF_LIVES))]
        out = []
        for e in range(E):
            cell = layer * E + e
            f = [self.hit[cell][h] * rate for h in range(len(HALF_LIVES))]
            f += [self.sal[cell][h] * E / sal_sum[h] if sal_sum[h] > 0 else 0.0
                  for h in range(len(HALF_LIVES))]
            f.append(win_hits[e] / WINDOW * rate)
            f.append(win_sal[e] * E / win_sum if win_sum > 0 else 0.0)
            if self.last_hit[cell] == 0:
                f.append(1.0)
            else:
                age = min(self.position - self.last_hit[cell], MAX_AGE)
                f.append(math.log2(1.0 + age) / AGE_SCALE)
            f.append(math.log2(1.0 + self.position) / POSITION_SCALE)
            f.append(1.0 if resident[e] else 0.0)
            f.append(self.seq_hits[cell] * rate / max(self.position, 1))
            out.append(f)
        return out


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


# ---------------------------------------------------------------- model

def forward(params, geometry, layer, feats):
    """jf_model.h's forward: expected hits in the next HORIZON tokens, one per expert."""
    E, H, D, Q = (geometry[k] for k in ("experts_per_layer", "hidden", "features", "queries"))
    emb, w_in, b_in = params["emb"], params["w_in"], params["b_in"]
    h0 = []
    for e in range(E):
        row = []
        for i in range(H):
            acc = b_in[i] + emb[(layer * E + e) * H + i]
            acc += sum(w_in[i * D + d] * feats[e][d] for d in range(D))
            row.append(max(acc, 0.0))
        h0.append(row)
    ctx = []
    for q in range(Q):
        query = params["query"][q * H:(q + 1) * H]
        logits = [sum(query[i] * h0[e][i] for i in range(H)) / math.sqrt(H) for e in range(E)]
        top = max(logits)
        a = [math.exp(x - top) for x in logits]
        total = sum(a)
        ctx += [sum(a[e] * h0[e][i] for e in range(E)) / total for i in range(H)]
    g = [params["b_h"][i] + sum(params["w_ctx"][i * Q * H + j] * ctx[j] for j in range(Q * H))
         for i in range(H)]
    out = []
    for e in range(E):
        y = params["b_out"][0]
        for i in range(H):
            acc = g[i] + sum(params["w_h"][i * H + j] * h0[e][j] for j in range(H))
            y += params["w_out"][i] * max(acc, 0.0)
        out.append(y if y > 20 else math.log1p(math.exp(y)))
    return out


def shapes(geometry):
    L, E, H, D, Q = (geometry[k] for k in ("num_layers", "experts_per_layer", "hidden", "features",
                                           "queries"))
    return {"emb": [L, E, H], "w_in": [H, D], "b_in": [H], "query": [Q, H], "w_ctx": [H, Q * H],
            "w_h": [H, H], "b_h": [H], "w_out": [H], "b_out": [1]}


def write_model(path, geometry, params):
    """params: name -> flat list of floats (row-major); geometry: the metadata integers."""
    meta = {"format": "nq-jf", "version": "1", "feature_set": FEATURE_SET}
    meta.update({k: str(v) for k, v in geometry.items()})
    header = {"__metadata__": meta}
    blobs = []
    offset = 0
    for name in TENSOR_ORDER:
        shape = shapes(geometry)[name]
        values = params[name]
        if len(values) != math.prod(shape):
            raise ValueError(f"{name}: {len(values)} values for shape {shape}")
        blob = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_model(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__")
    geometry = {k: int(meta[k]) for k in ("num_layers", "experts_per_layer", "top_k", "features",
                                          "hidden", "queries", "horizon")}
    params = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        params[name] = list(struct.unpack_from(f"<{(e - b) // 4}f", data, 8 + n + b))
    return geometry, params


def deterministic_params(geometry, seed):
    """Small weights from a fixed LCG: a model file any machine can rebuild bit for bit."""
    state = [seed & 0xFFFFFFFF]

    def uniform():
        state[0] = (1664525 * state[0] + 1013904223) & 0xFFFFFFFF
        return state[0] / 2.0 ** 32 - 0.5

    params = {}
    for name in TENSOR_ORDER:
        count = math.prod(shapes(geometry)[name])
        params[name] = [f32(2.0 * uniform()) for _ in range(count)]
    return params
