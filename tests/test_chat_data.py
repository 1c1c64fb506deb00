"""`peftx.train.encode_chat`: chat rows rendered with the tokenizer's own template, the
loss on the assistant's turns only, found from the template's generation markers or by
rendering prefixes; against labels written out by hand here."""

import numpy as np
import pytest
from helpers import unpacked, word_tokenizer

from peftx.train import IGNORE, encode_chat

WORDS = ["[PAD]", "[UNK]", "</s>", "system", "user", "assistant", "eot", "turns"]
WORDS += [f"w{i}" for i in range(20)]
# "role content eot" per message, and the role word as the generation prompt
PLAIN = (
    "{% for m in messages %}{{ m.role }} {{ m.content }} eot {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
# the same text, the assistant's turns inside generation markers
MARKED = (
    "{% for m in messages %}{% if m.role == 'assistant' %}assistant "
    "{% generation %}{{ m.content }} eot {% endgeneration %}"
    "{% else %}{{ m.role }} {{ m.content }} eot {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
CHATS = [
    [
        {"role": "system", "content": "w1"},
        {"role": "user", "content": "w2 w3"},
        {"role": "assistant", "content": "w4 w5 w6"},
        {"role": "user", "content": "w7"},
        {"role": "assistant", "content": "w8"},
    ],
    [{"role": "user", "content": "w9 w10 w11"}, {"role": "assistant", "content": "w12"}],
]


def _tokenizer(template):
    tok = word_tokenizer(WORDS)
    tok.chat_template = template
    return tok


def _by_hand(chat):
    """Ids and labels written out: each message is its role word, its words and `eot`;
    an assistant's words and `eot` are labelled, nothing else."""
    ids, labels = [], []
    for m in chat:
        words = [WORDS.index(w) for w in m["content"].split()] + [WORDS.index("eot")]
        ids += [WORDS.index(m["role"]), *words]
        learned = m["role"] == "assistant"
        labels += [IGNORE] + (words if learned else [IGNORE] * len(words))
    return ids, labels


@pytest.mark.parametrize("template", [PLAIN, MARKED], ids=["prefixes", "markers"])
def test_assistant_turns_only_are_learned(template):
    data = encode_chat(_tokenizer(template), CHATS, max_length=24)
    for row, chat in enumerate(CHATS):
        ids, labels = _by_hand(chat)
        n = len(ids)
        np.testing.assert_array_equal(data["input_ids"][row, :n], ids)
        np.testing.assert_array_equal(data["labels"][row, :n], labels)
        np.testing.assert_array_equal(data["attention_mask"][row], np.arange(24) < n)
        assert (data["labels"][row, n:] == IGNORE).all()


def test_packed_chats_keep_their_labels():
    data = encode_chat(_tokenizer(MARKED), CHATS * 4, max_length=24, pack=True)
    want = [(ids, [IGNORE, *labels[1:]]) for ids, labels in map(_by_hand, CHATS * 4)]
    assert sorted(unpacked(data)) == sorted(want)


def test_a_template_that_cannot_mark_the_assistant_is_refused():
    """A template whose rendering of a conversation's beginning is not a beginning of the
    whole (here, it counts the messages first) and has no markers."""
    counting = "{{ messages | length }} turns " + PLAIN
    refusal = (
        r"row 1: .*no {% generation %} markers.*a training chat template that has them.*"
        r"TRL ships one for Qwen3: trl/chat_templates/qwen3_training.jinja.*\(prompt_column\)"
    )
    with pytest.raises(ValueError, match=refusal):
        encode_chat(_tokenizer(counting), CHATS, max_length=24)


# ChatML as Qwen renders it, and the same with TRL's generation markers: TRL's training
# templates (trl/chat_templates/README.md) leave the `<|im_start|>assistant\n` cue outside and
# put the content and `<|im_end|>\n` (what the model must learn to produce and stop on) inside
CHATML_PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_MARKED = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m.content }}<|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _chatml_tokenizer(template):
    """Words split at spaces, each newline a token of its own (as in Qwen's vocabulary)."""
    import tokenizers
    import transformers

    pre = tokenizers.pre_tokenizers
    words = ["[PAD]", "[UNK]", "<|im_start|>", "<|im_end|>", "\n", "system", "user"]
    words += ["assistant", *(f"w{i}" for i in range(20))]
    model = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    )
    model.pre_tokenizer = pre.Sequence([pre.Split("\n", "isolated"), pre.Split(" ", "removed")])
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model,
        unk_token="[UNK]",
        pad_token="[PAD]",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = template
    return tok, words


@pytest.mark.parametrize("template", [CHATML_PLAIN, CHATML_MARKED], ids=["prefixes", "markers"])
def test_chatml_turns_are_learned_as_trl_marks_them(template):
    """The newline after `<|im_end|>` closes the assistant's turn: learned, as inside TRL's
    generation markers; the `<|im_start|>assistant` cue and its newline are not."""
    tok, words = _chatml_tokenizer(template)
    data = encode_chat(tok, CHATS, max_length=40)
    for row, chat in enumerate(CHATS):
        ids, labels = [], []
        for m in chat:
            content = [words.index(w) for w in m["content"].split()]
            close = [words.index("<|im_end|>"), words.index("\n")]
            head = [words.index("<|im_start|>"), words.index(m["role"]), words.index("\n")]
            ids += head + content + close
            learned = content + close if m["role"] == "assistant" else [IGNORE] * (len(content) + 2)
            labels += [IGNORE] * 3 + learned
        n = len(ids)
        np.testing.assert_array_equal(data["input_ids"][row, :n], ids)
        np.testing.assert_array_equal(data["labels"][row, :n], labels)
        assert (data["labels"][row, n:] == IGNORE).all()


def test_markers_need_no_rendering_of_prefixes():
    """With generation markers the same counting template is read: the turns come from
    the markers, and the two words in front are left out of the loss."""
    data = encode_chat(_tokenizer("{{ messages | length }} turns " + MARKED), CHATS, max_length=24)
    for row, chat in enumerate(CHATS):
        ids, labels = _by_hand(chat)
        front = [WORDS.index("[UNK]"), WORDS.index("turns")]  # the count is no word here
        np.testing.assert_array_equal(data["input_ids"][row, : len(ids) + 2], front + ids)
        np.testing.assert_array_equal(data["labels"][row, : len(ids) + 2], [IGNORE] * 2 + labels)


@pytest.mark.parametrize(
    "rows, error, words",
    [
        (["w1 w2"], TypeError, "row 1 holds a str"),
        ([[{"role": "user"}]], TypeError, "row 1, message 1 is a dict"),
        ([[{"role": "user", "content": "w1"}]], ValueError, "row 1 has no assistant message"),
        ([], ValueError, "no rows"),
    ],
)
def test_bad_rows_are_named(rows, error, words):
    with pytest.raises(error, match=words):
        encode_chat(_tokenizer(PLAIN), rows, max_length=24)


def test_a_tokenizer_without_a_template_is_refused():
    with pytest.raises(ValueError, match="no chat template"):
        encode_chat(word_tokenizer(WORDS), CHATS, max_length=24)


@pytest.mark.command_run
def test_finetune_trains_on_a_messages_column(llama, tmp_path, capsys):
    """`[data] messages_column`: `peftx finetune` renders each row with the checkpoint's
    own template and counts the assistant's tokens only; bad combinations are one line."""
    import shutil

    from helpers import run_cli, write_jsonl
    from transformers import AutoTokenizer

    base = tmp_path / "base"
    shutil.copytree(llama / "base", base)
    tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
    tok.chat_template = MARKED
    tok.save_pretrained(base)
    rng = np.random.default_rng(0)

    def chats(n):
        out = []
        for _ in range(n):
            start = int(rng.integers(5, 50))
            ask = " ".join(f"w{start + k}" for k in range(3))
            answer = " ".join(f"w{start + 3 + k}" for k in range(3))
            out.append(
                {
                    "messages": [
                        {"role": "user", "content": ask},
                        {"role": "assistant", "content": answer},
                    ]
                }
            )
        return out

    write_jsonl(tmp_path / "train.jsonl", chats(64))
    write_jsonl(tmp_path / "eval.jsonl", chats(16))
    job = (llama / "job.toml").read_text()
    job = job.replace('path = "base"', f'path = "{base}"')
    job = job.replace('train = "train.jsonl"', f'train = "{tmp_path / "train.jsonl"}"')
    job = job.replace('eval = "eval.jsonl"', f'eval = "{tmp_path / "eval.jsonl"}"')
    text = 'text_column = "answer"\nprompt_column = "question"'
    assert text in job
    job = job.replace(text, 'messages_column = "messages"')
    (tmp_path / "job.toml").write_text(job)
    sets = ["--set", f"output.dir={tmp_path / 'out'}", "--set", "train.steps=4"]
    sets += ["--set", "data.pack=false"]  # one row per chat: the counts below
    code, out, err = run_cli(capsys, "finetune", tmp_path / "job.toml", *sets)
    assert code == 0, err
    # 4 tokens per row learned: the answer's 3 words and the end of the turn
    assert "supervised tokens: 256 in" in out and ", 64 in" in out, out
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()

    code, _, err = run_cli(
        capsys, "finetune", tmp_path / "job.toml", *sets, "--set", "data.prompt_column=question"
    )
    assert code == 2 and "two formats" in err and err.count("\n") == 1, err


def test_generate_chat_renders_the_prompt_with_the_template(llama, tmp_path, capsys):
    """`peftx generate --chat P` continues the template's rendering of a user message P
    with the assistant's turn to follow: the same text as generating from that rendering,
    written out here, as a plain prompt."""
    import shutil

    from helpers import run_cli
    from transformers import AutoTokenizer

    base = tmp_path / "base"
    shutil.copytree(llama / "base", base)
    tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
    tok.chat_template = PLAIN
    tok.save_pretrained(base)
    argv = ["generate", base, "--max-new-tokens", 5]
    code, chat, err = run_cli(capsys, *argv, "--chat", "w5 w6 w7")
    assert code == 0, err
    code, plain, err = run_cli(capsys, *argv, "user w5 w6 w7 eot assistant")
    assert code == 0, err
    assert chat == plain
    code, other, _ = run_cli(capsys, *argv, "w5 w6 w7")
    assert code == 0 and other != chat  # the template changed what was generated from

    code, _, err = run_cli(capsys, "generate", llama / "base", "--chat", "w5")
    assert code == 2 and "has no chat template" in err, err


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.command_run
def test_bundled_chat_job_runs_on_a_tiny_qwen3(tmp_path, capsys):
    """configs/lora_qwen_chat.toml as shipped, on a tiny random Qwen3 given with `--set
    model.path=...` (a word-level tokenizer over the dataset's words, with a ChatML
    template as Qwen's): it writes an adapter, and the tokens it learns are the
    assistant's words and end-of-turn tokens, counted here from the conversations and
    the packing of max_length rows."""
    import json
    from pathlib import Path

    import tokenizers
    import transformers
    from helpers import run_cli
    from test_llama import torch_model

    job = Path(__file__).parents[1] / "configs" / "lora_qwen_chat.toml"
    data = job.parent / "data" / "support_chats"
    split = tokenizers.pre_tokenizers.Whitespace().pre_tokenize_str

    def words(text):
        return [w for w, _ in split(text)]

    chats = {
        name: [json.loads(line)["messages"] for line in (data / f"{name}.jsonl").open()]
        for name in ("train", "eval")
    }
    texts = [m["content"] for c in chats["train"] + chats["eval"] for m in c]
    vocab = ["[PAD]", "[UNK]", "<|im_start|>", "<|im_end|>", "system", "user", "assistant"]
    vocab += sorted({w for t in texts for w in words(t)} - set(vocab))
    model = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]")
    )
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model,
        unk_token="[UNK]",
        pad_token="[PAD]",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHATML
    base = tmp_path / "qwen3"
    torch_model("qwen3", vocab_size=len(vocab)).save_pretrained(base)
    tok.save_pretrained(base)

    length = 64

    def learned(conversations):
        """Tokens the loss predicts: each message is `<|im_start|>`, its role, its words and
        `<|im_end|>`; an assistant's words and `<|im_end|>` are learned, each chat whole
        in a packed row, cut to its first `length` tokens."""
        total = 0
        for chat in conversations:
            flags = []
            for m in chat:
                mine = m["role"] == "assistant"
                flags += [False, False] + [mine] * (len(words(m["content"])) + 1)
            total += sum(flags[:length])
        return total

    sets = [f"model.path={base}", f"output.dir={tmp_path / 'out'}", "train.steps=3"]
    sets += [f"data.max_length={length}", "train.eval_every=1000", "train.log_every=1"]
    args = [a for s in sets for a in ("--set", s)]
    code, out, err = run_cli(capsys, "finetune", job, *args)
    assert code == 0, err
    want = f"supervised tokens: {learned(chats['train'])} in {data / 'train.jsonl'}, "
    assert want + f"{learned(chats['eval'])} in {data / 'eval.jsonl'}" in out, out
    for name in ("train", "eval"):
        assert f"packed {data / name}.jsonl: all {len(chats[name])} examples, each whole" in out
    assert "are longer than max_length=64 and are truncated to it" in err, err
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
