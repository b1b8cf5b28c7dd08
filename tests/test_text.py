"""The text layer (dflash_jax/text.py): tokenizers and chat templates as transformers reads and renders
them, generation from strings, and streaming text that joins to exactly the output's text."""
import dataclasses
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from conftest import tiny_drafter, tiny_target

import dflash_jax
from dflash_jax import CheckpointError, text
from dflash_jax.demo import DEMO_DIR

DEMO_TARGET = os.path.join(DEMO_DIR, "target")
TEXTS = ["def f(x):\n    return x + 1\n", "  naïve café — 日本語 🙂 ", "<|endoftext|>after", ""]

QWEN_STYLE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' }}{{- tool | tojson }}
{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(users=0) %}
{% for message in messages %}
    {% if message.role not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + message.role) }}
    {% endif %}
    {% if message.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}
    {% if message.role == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message.content }}{% endgeneration %}<|im_end|>
    {% elif message.role != 'system' or not loop.first %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
    {% endif %}
{% endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
{%- if ns.users == 0 %}{{ raise_exception('No user query found in messages.') }}{% endif %}"""

CHATS = [
    [{"role": "user", "content": "Write fib."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🙂"},
     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again"}],
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a <b> & c",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "int"}}}}}]


def _copy_tokenizer(dest, config_update=None, template=QWEN_STYLE, files=("tokenizer.json", "tokenizer_config.json")):
    """The demo tokenizer in `dest`, with a Qwen-style chat template, <|im_start|>/<|im_end|> added at 4096
    and 4097 through tokenizer_config's added_tokens_decoder, <|im_end|> its EOS, and generation stop ids."""
    os.makedirs(dest, exist_ok=True)
    for f in files:
        shutil.copy(os.path.join(DEMO_TARGET, f), dest)
    config = json.load(open(os.path.join(DEMO_TARGET, "tokenizer_config.json")))
    config.update(eos_token="<|im_end|>", chat_template=template, added_tokens_decoder={
        str(i): {"content": t, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False,
                 "special": True} for i, t in ((4096, "<|im_start|>"), (4097, "<|im_end|>"))})
    config.update(config_update or {})
    json.dump(config, open(os.path.join(dest, "tokenizer_config.json"), "w"))
    json.dump({"eos_token_id": [4097, 0]}, open(os.path.join(dest, "generation_config.json"), "w"))
    return str(dest)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return _copy_tokenizer(tmp_path_factory.mktemp("chat"))


def test_demo_tokenizer_encodes_and_decodes_as_transformers_does():
    ours = dflash_jax.load_tokenizer(DEMO_TARGET)
    ref = transformers.AutoTokenizer.from_pretrained(DEMO_TARGET)
    for s in TEXTS:
        ids = ours.encode(s)
        assert ids == ref(s)["input_ids"], s
        assert ours.decode(ids) == ref.decode(ids) == s
    assert ours.vocab_size == len(ref) == 4096
    assert ours.eos_ids == (ref.eos_token_id,) == (0,) and ours.stop_tokens == (0,)
    assert ours.chat_template is None
    assert isinstance(dflash_jax.load_demo().tokenizer, dflash_jax.Tokenizer)


def test_chat_template_renders_and_encodes_as_transformers_does(chat_dir):
    ours = dflash_jax.load_tokenizer(chat_dir)
    ref = transformers.AutoTokenizer.from_pretrained(chat_dir)
    assert ours.vocab_size == len(ref) == 4098
    assert ours.stop_tokens == (4097, 0) and ours.eos_ids == (ref.eos_token_id,) == (4097,)
    for chat in CHATS:
        for kwargs in ({}, {"enable_thinking": False}, {"tools": TOOLS}, {"add_generation_prompt": False}):
            kwargs = {"add_generation_prompt": True, **kwargs}
            rendered = ours.apply_chat_template(chat, **kwargs)
            assert rendered == ref.apply_chat_template(chat, tokenize=False, **kwargs), (chat, kwargs)
            ids = ref.apply_chat_template(chat, tokenize=True, **kwargs)
            assert ours.encode_chat(chat, **kwargs) == list(getattr(ids, "input_ids", ids)), (chat, kwargs)
    assert "<|im_start|>assistant\n<think>" in ours.apply_chat_template(CHATS[0], enable_thinking=False)
    assert ours.encode("<|im_start|>user") == ref("<|im_start|>user")["input_ids"] and \
        ours.encode("<|im_start|>user")[0] == 4096


def test_chat_template_file_wins_over_the_config_and_named_templates_pick_default(tmp_path):
    folder = _copy_tokenizer(tmp_path / "a")
    (tmp_path / "a" / text.CHAT_TEMPLATE_FILE).write_text("FILE{{ messages[0].content }}")
    assert dflash_jax.load_tokenizer(folder).apply_chat_template(CHATS[0]) == "FILEWrite fib."
    named = _copy_tokenizer(tmp_path / "b", {"chat_template": [{"name": "tool_use", "template": "T"},
                                                               {"name": "default", "template": "D"}]})
    assert dflash_jax.load_tokenizer(named).apply_chat_template(CHATS[0]) == "D"
    nameless = _copy_tokenizer(tmp_path / "c", {"chat_template": [{"name": "tool_use", "template": "T"}]})
    with pytest.raises(CheckpointError, match="no 'default'"):
        dflash_jax.load_tokenizer(nameless)


def test_tokenizer_json_decides_the_bos_and_add_bos_token_does_not_as_in_transformers(tmp_path):
    """transformers 5 ignores `add_bos_token` when tokenizer.json exists: its post-processor adds what it adds."""
    folder = _copy_tokenizer(tmp_path, {"bos_token": "<|endoftext|>", "add_bos_token": False})
    spec = json.load(open(tmp_path / "tokenizer.json"))
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    seq = [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}]
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [bos, seq[0]], "pair": seq, "special_tokens": {
        "<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}}}
    json.dump(spec, open(tmp_path / "tokenizer.json", "w"))
    ours, ref = dflash_jax.load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    assert ours.encode("x = 1") == ref("x = 1")["input_ids"] and ours.encode("x = 1")[0] == 0
    assert ours.encode("x = 1", add_special_tokens=False) == ours.encode("x = 1")[1:]
    assert ours.encode_chat(CHATS[0]) == ref.apply_chat_template(CHATS[0], add_generation_prompt=True)["input_ids"]
    _update(tmp_path / "tokenizer_config.json", add_bos_token=True, bos_token="<|im_start|>")
    assert dflash_jax.load_tokenizer(folder).encode("x = 1")[0] == 0 == \
        transformers.AutoTokenizer.from_pretrained(folder)("x = 1")["input_ids"][0]


def test_chat_refusals_name_the_problem(chat_dir):
    demo = dflash_jax.load_tokenizer(DEMO_TARGET)
    with pytest.raises(ValueError, match="has no chat template"):
        demo.apply_chat_template(CHATS[0])
    tok = dflash_jax.load_tokenizer(chat_dir)
    with pytest.raises(ValueError, match="refused the conversation: unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="No user query"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[0\]\['content'\] is <object .*\(object\): a chat template takes"):
        tok.apply_chat_template([{"role": "user", "content": object()}])
    for bad in ([], "hello", [["user", "hi"]]):
        with pytest.raises(ValueError, match="non-empty list of message dicts"):
            tok.apply_chat_template(bad)


@pytest.mark.parametrize("template, error", [
    ("{{ messages.__class__.__mro__ }}", "sandbox"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "sandbox"),
    ("{% set ns = namespace(_x=1) %}{{ ns }}", "sandbox"),
    ("{{ lipsum.__globals__['os'] }}", "sandbox"),
    ("{{ cycler.__init__.__globals__ }}", "sandbox"),
    ("{% include 'tokenizer.json' %}", "includes, imports or extends"),
    ("{% import '/etc/passwd' as x %}", "includes, imports or extends"),
    ("{% if %}", "not valid jinja"),
])
def test_an_untrusted_template_cannot_leave_the_sandbox(tmp_path, template, error):
    tok = dflash_jax.load_tokenizer(_copy_tokenizer(tmp_path, template=template))
    with pytest.raises(CheckpointError, match=error):
        tok.apply_chat_template(CHATS[0])


def test_unsafe_attributes_render_as_nothing(tmp_path):
    template = "[{{ raise_exception.__globals__ }}{{ strftime_now.__globals__ }}{{ dict.mro }}]"
    assert dflash_jax.load_tokenizer(_copy_tokenizer(tmp_path, template=template)).apply_chat_template(CHATS[0]) \
        == "[]"


def test_paths_named_in_the_config_are_not_read(tmp_path):
    """tokenizer_config may name files (`tokenizer_file`, ...); only the folder's own tokenizer.json is read."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text("not json")
    folder = _copy_tokenizer(tmp_path / "tok", {"tokenizer_file": str(other / "tokenizer.json"),
                                                "vocab_file": "../other/tokenizer.json"})
    assert dflash_jax.load_tokenizer(folder).vocab_size == 4098


@pytest.mark.parametrize("edit, error", [
    (lambda d: os.remove(d / "tokenizer.json"), "no tokenizer.json"),
    (lambda d: (d / "tokenizer.json").write_text("{}"), "not a tokenizers file"),
    (lambda d: (d / "tokenizer_config.json").write_text("[1]"), "expected a JSON object"),
    (lambda d: _update(d / "tokenizer_config.json", added_tokens_decoder={"7": {"content": "<|im_end|>"}}),
     "has id 7, but tokenizer.json gives it"),
    (lambda d: _update(d / "tokenizer_config.json", eos_token="<|nope|>"), "eos_token '<|nope|>' is not a token"),
    (lambda d: _update(d / "tokenizer_config.json", eos_token=3), "expected a token string"),
    (lambda d: _update(d / "generation_config.json", eos_token_id=[0, -1]), "eos_token_id has token id -1"),
    (lambda d: _update(d / "generation_config.json", eos_token_id="0"), "eos_token_id='0' is not a list"),
    (lambda d: _update(d / "tokenizer_config.json", chat_template=7), "expected jinja source text"),
])
def test_malformed_tokenizer_folders_are_refused_naming_the_file(tmp_path, edit, error):
    folder = _copy_tokenizer(tmp_path)
    edit(tmp_path)
    with pytest.raises(CheckpointError, match=error):
        dflash_jax.load_tokenizer(folder)


def _update(file, **fields):
    data = json.load(open(file))
    data.update(fields)
    json.dump(data, open(file, "w"))


def test_decode_refuses_ids_outside_the_vocabulary():
    tok = dflash_jax.load_tokenizer(DEMO_TARGET)
    for bad in ([4096], [-1], [1.5], "abc"):
        with pytest.raises(ValueError, match="token id"):
            tok.decode(bad)
    with pytest.raises(ValueError, match="encode takes text"):
        tok.encode([1, 2])


class _Bursts:
    """A stand-in for a one-row Session that returns preset bursts (the real one is tested below)."""

    def __init__(self, bursts):
        self.bursts, self.stats = list(bursts), "stats"

    def burst(self, n):
        return dflash_jax.Burst([self.bursts.pop(0)], 1, 0, 0, 0.0, [0])

    @property
    def finished(self):
        return not self.bursts


@pytest.mark.parametrize("size", [1, 2, 3])
def test_stream_deltas_hold_back_a_split_character_and_join_to_the_whole_text(size):
    tok = dflash_jax.load_tokenizer(DEMO_TARGET)
    ids = tok.encode("é日本🙂 x 語")
    assert any(tok.decode(ids[:i]).endswith("\ufffd") for i in range(len(ids))), "no character is split"
    bursts = [ids[i:i + size] for i in range(0, len(ids), size)]
    chunks = list(text._chunks(_Bursts(bursts), size, tok, set()))
    assert "".join(c.text for c in chunks) == tok.decode(ids) == "é日本🙂 x 語"
    assert not any("\ufffd" in c.text for c in chunks), [c.text for c in chunks]
    assert [c.tokens for c in chunks] == bursts and [c.finished for c in chunks] == [False] * (len(bursts) - 1) + [True]
    assert chunks[-1].stats == "stats" and all(c.stats is None for c in chunks[:-1])
    cut = next(i for i in range(len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    truncated = ids[:cut]  # the output really ends inside a character: its U+FFFD is the last chunk's
    chunks = list(text._chunks(_Bursts([truncated[:1], truncated[1:]]), 1, tok, set()))
    assert "".join(c.text for c in chunks) == tok.decode(truncated) and chunks[-1].text.endswith("\ufffd")


@pytest.fixture(scope="module")
def pair():
    target = tiny_target(vocab=4098)
    return target, tiny_drafter(target, block_size=4)


def test_generate_text_is_generate_with_text_in_and_out(pair, chat_dir):
    target, drafter = pair
    tok = dflash_jax.load_tokenizer(chat_dir)
    prompts = ["import os\n", "class A:\n"]
    ids = [tok.encode(p) for p in prompts]
    ref = dflash_jax.generate(target, drafter, ids, max_new_tokens=12, stop_tokens=())
    out = dflash_jax.generate_text(target, drafter, prompts, tokenizer=tok, max_new_tokens=12, stop_tokens=())
    assert out.tokens == ref.tokens and out.texts == [tok.decode(t) for t in ref.tokens]
    assert isinstance(out.stats, dflash_jax.Stats) and out.stats.generated == 24
    stop = ref.tokens[0][5]
    cut = ref.tokens[0][:ref.tokens[0].index(stop) + 1]
    out = dflash_jax.generate_text(target, drafter, prompts, tokenizer=tok, max_new_tokens=12, stop_tokens=[stop])
    assert out.tokens[0] == cut and out.texts[0] == tok.decode(cut[:-1]), "the stop token: kept in tokens, not text"
    plain = dflash_jax.generate_text(target, None, prompts, tokenizer=tok, max_new_tokens=12, stop_tokens=[stop])
    assert plain.tokens == out.tokens and plain.texts == out.texts


def test_generate_text_renders_chats_and_stops_at_the_tokenizers_stop_tokens(pair, chat_dir):
    target, drafter = pair
    tok = dflash_jax.load_tokenizer(chat_dir)
    rendered = [tok.encode_chat(c, enable_thinking=False) for c in CHATS]
    ref = dflash_jax.generate(target, drafter, rendered, max_new_tokens=12, stop_tokens=tok.stop_tokens)
    for prompts in (CHATS, ["Write fib.", CHATS[1]]):  # a string with chat=True is one user message
        out = dflash_jax.generate_text(target, drafter, prompts, tokenizer=tok, max_new_tokens=12, chat=True,
                                       chat_template_kwargs={"enable_thinking": False})
        assert out.tokens == ref.tokens
    assert text._prompt_ids(tok, CHATS[0], False, {"enable_thinking": False}) == rendered[:1], "one chat, one prompt"


@pytest.mark.parametrize("prompts, error", [
    ([], "non-empty list"), (None, "non-empty list"), ([[1, 2, 3]], "for token ids use dflash_jax.generate"),
    (["ok", 3], "prompt 1 is 3"), ([""], "prompt 0 .* encodes to no tokens"),
])
def test_generate_text_refuses_what_is_not_text(pair, prompts, error):
    target, drafter = pair
    tok = dflash_jax.load_tokenizer(DEMO_TARGET)
    with pytest.raises(ValueError, match=error):
        dflash_jax.generate_text(target, drafter, prompts, tokenizer=tok, max_new_tokens=4)


def test_a_stop_token_the_target_cannot_generate_is_refused_naming_the_tokenizer(pair, tmp_path):
    target, drafter = pair
    folder = _copy_tokenizer(tmp_path)
    _update(tmp_path / "generation_config.json", eos_token_id=[0, 5000])
    tok = dflash_jax.load_tokenizer(folder)
    assert tok.stop_tokens == (0, 5000, 4097)
    for run in (dflash_jax.generate_text, dflash_jax.stream):
        with pytest.raises(CheckpointError, match=f"stop token 5000 of the tokenizer in {folder} .* outside the "
                                                  r"target's vocabulary \[0, 4098\)"):
            run(target, drafter, "x", tokenizer=tok, max_new_tokens=4)


def test_a_drafter_in_another_dtype_than_its_target_is_refused_naming_the_fix(pair):
    target, drafter = pair
    tok = dflash_jax.load_tokenizer(DEMO_TARGET)
    bf16 = drafter.replace(params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), drafter.params))
    calls = (lambda: dflash_jax.generate(target, bf16, [[1, 2]], max_new_tokens=4),
             lambda: dflash_jax.propose(target, bf16, [[1, 2]]),
             lambda: dflash_jax.generate_text(target, bf16, "x", tokenizer=tok, max_new_tokens=4),
             lambda: dflash_jax.stream(target, bf16, "x", tokenizer=tok, max_new_tokens=4),
             lambda: dflash_jax.Session(target, bf16, [[1, 2]], max_new_tokens=4))
    for call in calls:
        with pytest.raises(ValueError, match=r"drafter's weights are bfloat16 and the target computes in float32: .*"
                                             r"load_drafter\(path, target\)"):
            call()


def test_text_calls_need_a_tokenizer_when_the_target_has_no_folder(pair):
    target, drafter = pair
    with pytest.raises(ValueError, match="not loaded by load_target: pass tokenizer="):
        dflash_jax.generate_text(target, drafter, "x", max_new_tokens=4)
    with pytest.raises(ValueError, match="must be a dflash_jax.Tokenizer"):
        dflash_jax.generate_text(target, drafter, "x", tokenizer=object(), max_new_tokens=4)


def test_stream_yields_the_sessions_tokens_as_text(pair, chat_dir):
    target, drafter = pair
    tok = dflash_jax.load_tokenizer(chat_dir)
    ids = tok.encode("def main():\n")
    ref = dflash_jax.generate(target, drafter, [ids], max_new_tokens=12, stop_tokens=tok.stop_tokens)
    chunks = list(dflash_jax.stream(target, drafter, "def main():\n", tokenizer=tok, max_new_tokens=12, burst=3))
    tokens = [t for c in chunks for t in c.tokens]
    assert tokens == ref.tokens[0]
    ends = set(tok.stop_tokens)
    body = tokens[:-1] if tokens[-1] in ends else tokens
    assert "".join(c.text for c in chunks) == tok.decode(body)
    assert chunks[-1].finished and chunks[-1].stats.generated == len(tokens) == ref.stats.generated
    assert all(len(c.tokens) <= 3 for c in chunks) and not any(c.finished for c in chunks[:-1])


def test_stream_refusals(pair):
    target, drafter = pair
    tok = dflash_jax.load_tokenizer(DEMO_TARGET)
    with pytest.raises(ValueError, match="needs a drafter"):
        dflash_jax.stream(target, None, "x", tokenizer=tok, max_new_tokens=4)
    with pytest.raises(ValueError, match="one prompt"):
        dflash_jax.stream(target, drafter, ["a", "b"], tokenizer=tok, max_new_tokens=4)
    with pytest.raises(ValueError, match="burst must be a positive integer"):
        dflash_jax.stream(target, drafter, "x", tokenizer=tok, max_new_tokens=4, burst=0)
    with pytest.raises(ValueError, match="has no chat template"):
        dflash_jax.stream(target, drafter, "x", tokenizer=tok, max_new_tokens=4, chat=True)


def test_template_context_is_plain_data(chat_dir):
    tok = dflash_jax.load_tokenizer(chat_dir)
    chat = [{"role": "user", "content": np.str_("numpy text"), "n": np.int64(3)}]
    assert tok.apply_chat_template(chat) == tok.apply_chat_template([{"role": "user", "content": "numpy text"}])
    with pytest.raises(ValueError, match=r"chat template keywords\['tools'\]\[0\] is <function .*\(function\)"):
        tok.apply_chat_template(CHATS[0], tools=[lambda: 0])


README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")


def _readme_section(title: str) -> str:
    text = open(README, encoding="utf-8").read()
    start = text.index(f"\n{title}\n")
    return text[start:text.index("\n## ", start + 1)]


def test_the_readme_api_example_runs_as_written(capsys):
    """The first python block of "Using the library", executed as a user would paste it."""
    block = re.search(r"```python\n(.*?)```", _readme_section("## Using the library"), re.S).group(1)
    assert "generate_text" in block and "tokenizer.encode" in block and "tokenizer.decode" in block
    exec(compile(block, "README.md", "exec"), {"__name__": "__readme__"})
    printed = capsys.readouterr().out
    assert printed.startswith("import os\n\n\ndef read_lines(path):\n    ") and "tokens per round" in printed


def test_the_readme_documents_every_stats_field():
    section = _readme_section("## Using the library")
    start = section.index("### What `Stats` holds")
    table = section[start:section.index("\n### ", start + 1)]  # other tables (precisions) also start with a name
    documented = set(re.findall(r"^\| `(\w+)` \|", table, re.M))
    fields = {f.name for f in dataclasses.fields(dflash_jax.Stats)} | {
        name for name, value in vars(dflash_jax.Stats).items() if isinstance(value, property)}
    assert fields == documented, f"undocumented: {fields - documented}; not fields: {documented - fields}"
