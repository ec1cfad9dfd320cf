"""Byte-level BPE tokenizer (HF `tokenizers`) with GLM-style special tokens.

Pre-tokenizer: GLM-4's split regex (letters, 1-3 digit groups, punctuation runs, newlines,
whitespace) followed by ByteLevel without its own regex; ByteLevel decoder and post-processor,
as the GLM / Qwen / DeepSeek tokenizers the C++ tokenizer is tested on.

Ids: the special tokens first (0 = <|endoftext|>), then the learned byte-level vocabulary,
then the non-special added tokens (<think>, <tool_call>, ...), for exactly `vocab_size` ids.
"""

import json
import os

# GLM-4 / GLM-5 pre-tokenizer split pattern.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
EOT = "<|endoftext|>"
# special=True: control tokens the chat template writes; skipped by skip_special_tokens.
SPECIAL = [EOT, "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
           "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
# special=False (as in GLM's tokenizer): text the reasoning / tool-call parsers must see.
PLAIN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
               "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
ALL_ADDED = SPECIAL + PLAIN_ADDED


def train(texts, vocab_size, min_frequency=2):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(PLAIN_ADDED), min_frequency=min_frequency,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED])
    for i, t in enumerate(SPECIAL):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def ids_of(tok):
    return {t: tok.token_to_id(t) for t in ALL_ADDED}


def save(tok, out_dir, chat_template, model_max_length):
    """tokenizer.json (exactly `tok`) + tokenizer_config.json for transformers' AutoTokenizer."""
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = {}
    for t in ALL_ADDED:
        added[str(tok.token_to_id(t))] = {"content": t, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False,
                                          "special": t in SPECIAL}
    cfg = {
        "added_tokens_decoder": added,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOT,
        "pad_token": EOT,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "do_lower_case": False,
        "remove_space": False,
        "chat_template": chat_template,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
