#!/usr/bin/env python3
"""Renders scripts/chat/conversations.json with transformers' apply_chat_template.

For each model family (templates/*.jinja, see templates/README.md) and each conversation, this
writes the exact string `tokenizer.apply_chat_template(messages, tools=..., tokenize=False,
add_generation_prompt=..., **kwargs)` returns, into tests/chat/data/expected_<model>.json. The
C++ renderer (services/chat) must reproduce every string byte for byte (tests/chat).

Run it where transformers is installed (the GPU machine: transformers 5.17, jinja2):

    python3 scripts/chat/make_chat_fixtures.py --out "$OUT"

`--backend replica` renders with a jinja2 environment built the way transformers builds its
own (no transformers needed); use it only while developing: the files it writes say so, and
the C++ fixture test refuses them.

The conversations are written in NestQuant's own chat schema (the fields of nq.v1.Chat), and
`to_hf` below turns them into the message dicts the templates read. The C++ renderer applies
the same conversion rules (services/chat/chat.h documents them), so a fixture pins both.
"""

import argparse
import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

MODELS = {
    "glm5": {
        "template": "templates/glm5.jinja",
        # GLM's tokenizer_config names no bos_token the template could read; eos is <|endoftext|>.
        "special_tokens": {"eos_token": "<|endoftext|>"},
    },
    "deepseek_v3": {
        "template": "templates/deepseek_v3.jinja",
        "special_tokens": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    },
}


class ConversionError(Exception):
    """The chat cannot be turned into template input (the C++ renderer rejects it too)."""


def parse_arguments(text):
    # An empty arguments_json means "no arguments" (some clients send ""), as in services/chat.
    if text == "":
        return {}
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConversionError(f"tool call arguments are not valid JSON: {e}") from e


def to_hf(chat, model):
    """nq Chat (plain dict) -> (messages, tools, template kwargs) for `model`'s template."""
    messages = []
    for m in chat["messages"]:
        d = {"role": m["role"]}
        content = m.get("content", "")
        calls = m.get("tool_calls", [])
        # DeepSeek-V3's template renders tool calls only for an assistant message whose content
        # is None; GLM's renders a None content as the text "None". So an assistant message
        # with tool calls and empty content carries None for DeepSeek-V3, "" for GLM.
        if model == "deepseek_v3" and m["role"] == "assistant" and calls and content == "":
            d["content"] = None
        else:
            d["content"] = content
        if m.get("reasoning_content"):
            d["reasoning_content"] = m["reasoning_content"]
        if calls:
            hf_calls = []
            for c in calls:
                if model == "glm5":
                    args = parse_arguments(c["arguments_json"])
                else:
                    args = c["arguments_json"]
                call = {"type": "function", "function": {"name": c["name"], "arguments": args}}
                if c.get("id"):
                    call = {"id": c["id"], **call}
                hf_calls.append(call)
            d["tool_calls"] = hf_calls
        if m.get("tool_call_id"):
            d["tool_call_id"] = m["tool_call_id"]
        if m.get("name"):
            d["name"] = m["name"]
        messages.append(d)
    tools = []
    for t in chat.get("tools", []):
        fn = {"name": t["name"]}
        if t.get("description"):
            fn["description"] = t["description"]
        if t.get("parameters_json"):
            try:
                fn["parameters"] = json.loads(t["parameters_json"])
            except json.JSONDecodeError as e:
                raise ConversionError(f"tool parameters are not valid JSON: {e}") from e
        tools.append({"type": "function", "function": fn})
    kwargs = {}
    if "enable_thinking" in chat:
        kwargs["enable_thinking"] = chat["enable_thinking"]
    return messages, (tools or None), kwargs


def replica_environment():
    """A jinja2 environment configured like transformers' _compile_jinja_template."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class GenerationTags(jinja2.ext.Extension):  # {% generation %} blocks render their body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Output(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTags, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


class Renderer:
    def __init__(self, backend):
        self.backend = backend
        if backend == "transformers":
            import transformers
            from tokenizers import Tokenizer, models

            try:
                from transformers import PreTrainedTokenizerFast as FastTokenizer
            except ImportError:
                from transformers import TokenizersBackend as FastTokenizer
            self._fast_cls = FastTokenizer
            self._tokenizers = (Tokenizer, models)
            self.versions = {"transformers": transformers.__version__}
        else:
            self.env = replica_environment()
            self.versions = {}
        import jinja2
        self.versions["jinja2"] = jinja2.__version__
        self.versions["python"] = sys.version.split()[0]

    def tokenizer(self, template, special_tokens):
        """A tokenizer object with no real vocabulary: only its chat template is exercised."""
        Tokenizer, models = self._tokenizers
        backend = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
        tok = self._fast_cls(tokenizer_object=backend, unk_token="<unk>", **special_tokens)
        tok.chat_template = template
        return tok

    def render(self, template, special_tokens, messages, tools, add_generation_prompt, kwargs):
        if self.backend == "transformers":
            tok = self.tokenizer(template, special_tokens)
            out = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                          add_generation_prompt=add_generation_prompt, **kwargs)
            if not isinstance(out, str):
                raise TypeError(f"apply_chat_template returned {type(out).__name__}, not str")
            return out
        compiled = self.env.from_string(template)
        return compiled.render(messages=messages, tools=tools,
                               add_generation_prompt=add_generation_prompt,
                               **special_tokens, **kwargs)

    def cross_check(self, template, special_tokens, messages, tools, add_generation_prompt, kwargs):
        """transformers' render_jinja_template and the replica, for the record (None: n/a)."""
        results = {}
        try:
            from transformers.utils.chat_template_utils import render_jinja_template
            rendered, _ = render_jinja_template(
                conversations=[messages], tools=tools, chat_template=template,
                add_generation_prompt=add_generation_prompt, **special_tokens, **kwargs)
            results["render_jinja_template"] = rendered[0]
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            results["render_jinja_template"] = f"error: {type(e).__name__}: {e}"
        try:
            env = replica_environment()
            results["replica"] = env.from_string(template).render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                **special_tokens, **kwargs)
        except Exception as e:  # noqa: BLE001
            results["replica"] = f"error: {type(e).__name__}: {e}"
        return results


def render_model(renderer, model, spec, cases, failures):
    with open(os.path.join(HERE, spec["template"]), encoding="utf-8") as f:
        template = f.read()
    out_cases = []
    mismatches = []
    for case in cases:
        chat = case["chat"]
        entry = {"name": case["name"], "chat": chat}
        expect_error = case.get("expect_error", {}).get(model)
        if expect_error:
            entry["expect_error"] = expect_error
        if case.get("note"):
            entry["note"] = case["note"]
        try:
            messages, tools, kwargs = to_hf(chat, model)
            text = renderer.render(template, spec["special_tokens"], messages, tools,
                                   chat["add_generation_prompt"], kwargs)
            if renderer.backend == "transformers":
                checks = renderer.cross_check(template, spec["special_tokens"], messages, tools,
                                              chat["add_generation_prompt"], kwargs)
                for k, v in checks.items():
                    if v != text:
                        mismatches.append(f"{model}/{case['name']}: {k} differs")
            result = {"rendered": text}
        except ConversionError as e:
            result = {"error": f"ConversionError: {e}"}
        except Exception as e:  # noqa: BLE001 - the template raised: that is the reference
            result = {"error": f"{type(e).__name__}: {e}"}
        if expect_error:
            # Our renderer rejects these; record what transformers did with them.
            entry["transformers"] = result
        elif "error" in result:
            failures.append(f"{model}/{case['name']}: unexpected error {result['error']}")
            entry["transformers"] = result
        else:
            entry["rendered"] = result["rendered"]
        out_cases.append(entry)
    return {
        "schema": "nq.chat.expected/1",
        "model": model,
        "generator": {
            "script": "scripts/chat/make_chat_fixtures.py",
            "backend": renderer.backend,
            "call": ("PreTrainedTokenizerFast.apply_chat_template(tokenize=False)"
                     if renderer.backend == "transformers" else "replica jinja2 environment"),
            "versions": renderer.versions,
            "template": spec["template"],
            "template_sha256": hashlib.sha256(template.encode("utf-8")).hexdigest(),
            "special_tokens": spec["special_tokens"],
        },
        "cases": out_cases,
    }, mismatches


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=["transformers", "replica"], default="transformers")
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "chat", "data"))
    ap.add_argument("--conversations", default=os.path.join(HERE, "conversations.json"))
    args = ap.parse_args()

    with open(args.conversations, encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    renderer = Renderer(args.backend)
    print("versions:", renderer.versions, flush=True)
    os.makedirs(args.out, exist_ok=True)
    all_mismatches = []
    failures = []
    for model, spec in MODELS.items():
        doc, mismatches = render_model(renderer, model, spec, cases, failures)
        all_mismatches += mismatches
        path = os.path.join(args.out, f"expected_{model}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False, indent=1)
            f.write("\n")
        n_err = sum(1 for c in doc["cases"] if "expect_error" in c)
        print(f"{path}: {len(doc['cases'])} cases ({n_err} expected errors)", flush=True)
    for m in all_mismatches:
        print("CROSS-CHECK MISMATCH:", m)
    if not all_mismatches and args.backend == "transformers":
        print("cross-check: render_jinja_template and the replica agree with apply_chat_template")
    for f in failures:
        print("FAILED:", f)
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
