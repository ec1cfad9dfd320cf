#!/usr/bin/env bash
# `nq tokenize` / `nq detokenize` end to end. Usage: nq_cli_test.sh NQ_BINARY DATA_DIR
set -euo pipefail
nq=$1
data=$2
fail() { echo "FAIL: $*" >&2; exit 1; }

tok="$data/qwen3.tokenizer.json.gz"

ids=$(printf '<|im_start|>user\nHello, 世界! 👋<|im_end|>' | "$nq" tokenize --tokenizer "$tok")
[[ $ids =~ ^[0-9]+(,[0-9]+)*$ ]] || fail "tokenize printed '$ids'"
[[ $ids == 151644,* ]] || fail "expected <|im_start|> (151644) first, got '$ids'"
[[ $ids == *,151645 ]] || fail "expected <|im_end|> (151645) last, got '$ids'"

text=$(printf '%s' "$ids" | "$nq" detokenize --tokenizer "$tok")
[[ $text == $'<|im_start|>user\nHello, 世界! 👋<|im_end|>' ]] || fail "round trip gave '$text'"
text=$(printf '%s' "$ids" | "$nq" detokenize --tokenizer "$tok" --skip_special_tokens)
[[ $text == $'user\nHello, 世界! 👋' ]] || fail "skip_special_tokens gave '$text'"

# Bytes come back exactly, including an invalid sequence's replacement.
printf 'a\xffb' | "$nq" tokenize --tokenizer "$data/llama3.tokenizer.json.gz" > /tmp/nq_cli_ids.$$
out=$("$nq" detokenize --tokenizer "$data/llama3.tokenizer.json.gz" < /tmp/nq_cli_ids.$$ | od -An -tx1 | tr -d ' \n')
rm -f /tmp/nq_cli_ids.$$
[[ $out == 61efbfbd62 ]] || fail "invalid input round trip gave bytes $out"

# Empty input: an empty line.
[[ $(printf '' | "$nq" tokenize --tokenizer "$tok") == "" ]] || fail "empty input"

# Errors: usage is exit 2, a bad file or bad ids exit 1 with a message.
set +e
"$nq" tokenize < /dev/null 2>/dev/null; [[ $? == 2 ]] || fail "missing --tokenizer should exit 2"
"$nq" tokenize --tokenizer /nonexistent.json < /dev/null 2>/tmp/nq_cli_err.$$; rc=$?
[[ $rc == 1 ]] && grep -q "cannot open" /tmp/nq_cli_err.$$ || fail "missing file: rc $rc"
printf '1,x' | "$nq" detokenize --tokenizer "$tok" 2>/tmp/nq_cli_err.$$; rc=$?
[[ $rc == 1 ]] && grep -q "'x' is not a token id" /tmp/nq_cli_err.$$ || fail "bad id: rc $rc"
printf '999999999' | "$nq" detokenize --tokenizer "$tok" 2>/tmp/nq_cli_err.$$; rc=$?
[[ $rc == 1 ]] && grep -q "not in the vocabulary" /tmp/nq_cli_err.$$ || fail "unknown id: rc $rc"
rm -f /tmp/nq_cli_err.$$
echo "1 passed, 0 failed"
