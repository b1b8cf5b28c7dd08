"""Text in, text out: a checkpoint's tokenizer and chat template, and generation from strings.

`load_tokenizer` reads what transformers 5 reads from a checkpoint folder: `tokenizer.json` (the
`tokenizers` library runs it; its post-processor decides what encoding a text adds, such as Llama 3's BOS,
and `add_bos_token` in the config does not), `tokenizer_config.json` (special and added tokens, the chat
template), `chat_template.jinja` when present, and the stop tokens of `generation_config.json` (else
`config.json`). Chat templates are rendered as transformers renders them: jinja2's immutable
sandbox, `trim_blocks`/`lstrip_blocks`, `raise_exception`, `tojson`, `strftime_now`, and the special
tokens in the context. Only those fixed file names in the folder are read; a template that includes,
imports or extends other files is refused, and the sandbox keeps Python internals out of its reach.

`generate_text` and `stream` wrap `generate` and `Session`: prompts are strings or chat message lists,
output is text without the prompt, and the stop tokens are the tokenizer's unless given.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import numbers
import os
from collections.abc import Mapping
from typing import Iterator, Optional

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
import tokenizers

from dflash_jax import api, hub
from dflash_jax import sampling as smp
from dflash_jax.config import CheckpointError
from dflash_jax.decoding.common import Stats, integer, integers
from dflash_jax.decoding.session import Session

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens of `tokenizer_config.json`; a chat template sees each one that is set."""
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""transformers' file for a checkpoint's chat template; it wins over `tokenizer_config.json`'s."""


class Tokenizer:
    """A checkpoint's tokenizer (see `load_tokenizer`).

    `encode(text)` / `decode(ids)` convert text and token ids; `apply_chat_template(messages)` renders a
    conversation. `stop_tokens` are the ids that end generation (the generation config's `eos_token_id`s
    and the tokenizer's EOS), `eos_ids` the tokenizer's own EOS, `special_tokens` the named special
    tokens (name -> text, or None when unset), `chat_template` the template source or None. `backend` is the
    `tokenizers.Tokenizer` underneath, `folder` where it was read from."""

    def __init__(self, backend: tokenizers.Tokenizer, *, special_tokens: Optional[Mapping[str, str]] = None,
                 chat_template: Optional[str] = None, stop_tokens: tuple = (), folder: Optional[str] = None):
        self.backend = backend
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self.folder = folder
        eos = self.special_tokens.get("eos_token")
        self.eos_ids = () if eos is None else (backend.token_to_id(eos),)
        self.stop_tokens = tuple(dict.fromkeys((*stop_tokens, *self.eos_ids)))

    def __repr__(self) -> str:
        return (f"Tokenizer({self.folder!r}, vocab_size={self.vocab_size}, stop_tokens={self.stop_tokens}, "
                f"chat_template={'yes' if self.chat_template else 'none'})")

    @property
    def vocab_size(self) -> int:
        """Token ids in use, added tokens included (a model's vocabulary may be padded beyond it)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`. `add_special_tokens` adds what the checkpoint adds to a text (e.g. Llama 3's
        BOS), as `transformers` does for `tokenizer(text)`; rendered chat templates hold their own."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes text (str); got {type(text).__name__} {text!r:.40}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of token ids (a list or 1-D array); ids outside the vocabulary are refused."""
        ids = integers("token ids", ids, 0, self.vocab_size, "token id", f"[0, {self.vocab_size})")
        return self.backend.decode(ids.tolist(), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True, **kwargs) -> str:
        """One conversation (a list of message dicts, e.g. `{"role": "user", "content": "..."}`) as the
        checkpoint's chat template renders it, with the assistant's header after it when
        `add_generation_prompt`. `kwargs` reach the template (`tools=[...]`, `enable_thinking=False`, ...);
        like the messages they must be plain data: strings, numbers, bools, None, lists and dicts.
        Refused: a tokenizer without a chat template, and messages the template refuses."""
        if self.chat_template is None:
            raise ValueError(f"the tokenizer of {self.folder} has no chat template (no chat_template in "
                             f"tokenizer_config.json, no {CHAT_TEMPLATE_FILE}): pass plain text prompts instead")
        if not isinstance(messages, (list, tuple)) or not messages or \
                not all(isinstance(m, Mapping) for m in messages):
            raise ValueError(f"a conversation is a non-empty list of message dicts; got {messages!r:.60}")
        messages = [{k: v for k, v in m.items() if v is not None} for m in _plain(list(messages), "messages")]
        context = {**{k: v for k, v in self.special_tokens.items() if v is not None}, "tools": None,
                   "documents": None, **_plain(kwargs, "chat template keywords"), "messages": messages,
                   "add_generation_prompt": bool(add_generation_prompt)}
        template = _compile(self.chat_template, self.folder)
        try:
            return template.render(context)
        except jinja2.exceptions.SecurityError as e:
            raise CheckpointError(f"the chat template of {self.folder} broke the sandbox's rules: {e}") from e
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template of {self.folder} refused the conversation: {e}") from e

    def encode_chat(self, messages: list, add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """`apply_chat_template` encoded, adding no special tokens beyond the template's own."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)


def _plain(value, where: str):
    """A copy of `value` made of plain data (str, int, float, bool, None, lists, tuples, dicts with string
    keys) for the template to see, as transformers copies it: objects with methods would widen what a
    sandboxed template can reach. Anything else is refused naming `where`."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, np.generic):
        return _plain(value.item(), where)
    for kind, base in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
        if isinstance(value, kind):  # a subclass (an enum, ...) as its base type, without its methods
            return base(value)
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise ValueError(f"{where}: dict keys must be strings; got {list(value)!r:.60}")
        return {str.__str__(k): _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    raise ValueError(f"{where} is {value!r:.40} ({type(value).__name__}): a chat template takes plain data "
                     "(strings, numbers, bools, None, lists and dicts)")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's `namespace()` refusing underscore names, as transformers' is: no dunder attributes."""

    def __init__(*args, **kwargs):
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_'; got {name!r}")


class _Dict:
    """The templates' `dict`: building dicts only, as transformers' is (no attributes of the type itself)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' `tojson`: no HTML escaping, unlike jinja2's."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile(source: str, folder: Optional[str]) -> jinja2.Template:
    """A chat template compiled in the environment transformers renders them in (`folder` names it in errors)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, namespace=_Namespace, dict=_Dict(),
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    try:
        tree = env.parse(source)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"the chat template of {folder} is not valid jinja (line {e.lineno}: {e.message})") \
            from e
    if any(tree.find_all((jinja2.nodes.Include, jinja2.nodes.Import, jinja2.nodes.FromImport, jinja2.nodes.Extends))):
        raise CheckpointError(f"the chat template of {folder} includes, imports or extends other templates; a chat "
                              "template must be one self-contained file (no other file is read)")
    return env.from_string(tree)


def load_tokenizer(path_or_id, *, revision: Optional[str] = None) -> Tokenizer:
    """The tokenizer of a checkpoint folder or Hugging Face repo id (see the module docstring).

    Refused with a `CheckpointError` naming the file: a missing or unreadable `tokenizer.json`, a
    malformed config, an added token whose id disagrees with `tokenizer.json`, an EOS token that is not
    one of its tokens."""
    folder = hub.resolve(path_or_id, revision=revision, what="tokenizer", files=hub.TOKENIZER_FILES)
    file = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(file):
        raise CheckpointError(f"{folder}: no tokenizer.json (the tokenizer file transformers' fast tokenizers "
                              "save): pass token ids, or a folder that has one")
    try:
        backend = tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # noqa: BLE001 - the Rust library raises plain Exceptions for malformed files
        raise CheckpointError(f"{file}: not a tokenizers file ({e})") from e
    config_file = os.path.join(folder, "tokenizer_config.json")
    config = _json(config_file) if os.path.isfile(config_file) else {}
    _add_tokens(backend, config.get("added_tokens_decoder") or {}, config_file)
    special = {name: _token_text(config.get(name), name, config_file) for name in SPECIAL_TOKENS}
    for name in ("bos_token", "eos_token"):
        if special[name] is not None and backend.token_to_id(special[name]) is None:
            raise CheckpointError(f"{config_file}: {name} {special[name]!r} is not a token of {file}")
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    return Tokenizer(backend, special_tokens=special, chat_template=_chat_template(folder, config, config_file),
                     stop_tokens=_stop_tokens(folder), folder=folder)


def _json(file: str) -> dict:
    try:
        with open(file, encoding="utf-8") as fh:
            value = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: not UTF-8 JSON ({e})") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: holds a JSON {type(value).__name__}; expected a JSON object")
    return value


def _token_text(value, name: str, file: str) -> Optional[str]:
    """A special token as transformers stores it: a string, or an AddedToken dict with its `content`."""
    if isinstance(value, Mapping):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise CheckpointError(f"{file}: {name} is {value!r:.40}; expected a token string, an AddedToken object "
                              "or null")
    return value


def _add_tokens(backend: tokenizers.Tokenizer, added: Mapping, file: str) -> None:
    """`added_tokens_decoder` (id -> AddedToken dict): tokens `tokenizer.json` lacks are added, as
    transformers adds them; each must end up at its id."""
    if not isinstance(added, Mapping):
        raise CheckpointError(f"{file}: added_tokens_decoder is {added!r:.40}; expected an object id -> token")
    for key, spec in added.items():
        if not str(key).isdigit() or not isinstance(spec, Mapping) or not isinstance(spec.get("content"), str):
            raise CheckpointError(f"{file}: added_tokens_decoder entry {key!r}: {spec!r:.60} is not id -> "
                                  "AddedToken object")
    for key, spec in sorted(added.items(), key=lambda kv: int(kv[0])):
        content = spec["content"]
        if backend.token_to_id(content) is None:
            flags = {k: bool(spec[k]) for k in ("single_word", "lstrip", "rstrip", "normalized") if k in spec}
            token = tokenizers.AddedToken(content, special=bool(spec.get("special", False)), **flags)
            if token.special:
                backend.add_special_tokens([token])
            else:
                backend.add_tokens([token])
        if backend.token_to_id(content) != int(key):
            raise CheckpointError(f"{file}: added token {content!r} has id {key}, but tokenizer.json gives it "
                                  f"{backend.token_to_id(content)}")


def _chat_template(folder: str, config: Mapping, config_file: str) -> Optional[str]:
    """`chat_template.jinja`, else tokenizer_config's `chat_template`: a string, or a list of named templates
    of which "default" is used."""
    file = os.path.join(folder, CHAT_TEMPLATE_FILE)
    if os.path.isfile(file):
        with open(file, encoding="utf-8") as fh:
            return fh.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        if "default" not in named:
            raise CheckpointError(f"{config_file}: chat_template lists templates {sorted(map(str, named))} and no "
                                  "'default' one")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{config_file}: chat_template is {template!r:.40}; expected jinja source text")
    return template


def _stop_tokens(folder: str) -> tuple:
    """`eos_token_id` (one id or a list) of generation_config.json, else of config.json (transformers derives
    the generation config from it). Checked against the target's vocabulary when used (`_default_stops`)."""
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(folder, name)
        if os.path.isfile(file) and (ids := _json(file).get("eos_token_id")) is not None:
            ids = [ids] if isinstance(ids, numbers.Integral) and not isinstance(ids, bool) else ids
            try:
                return tuple(integers("eos_token_id", ids, 0, 2**31, "token id", "[0, 2**31)").tolist())
            except ValueError as e:
                raise CheckpointError(f"{file}: {e}") from None
    return ()


@dataclasses.dataclass
class TextResult:
    """What `generate_text` made: per prompt the text after it (a final stop token's text excluded), the
    generated ids (a final stop token kept, as `generate` returns them), and the run's `Stats`."""

    texts: list
    tokens: list
    stats: Stats


@dataclasses.dataclass
class StreamChunk:
    """One burst of `stream`: the new text (`text`, joined over the chunks it is the whole output's text),
    the burst's new ids, whether this is the last chunk, and the run's `Stats` on the last chunk."""

    text: str
    tokens: list
    finished: bool
    stats: Optional[Stats] = None


def generate_text(target, drafter, prompts, *, tokenizer: Optional[Tokenizer] = None, max_new_tokens: int,
                  stop_tokens=None, sampling: smp.Sampling | list | None = smp.Sampling(), chat: bool = False,
                  chat_template_kwargs: Optional[dict] = None, **generate_kwargs) -> TextResult:
    """Generate from text: `generate` with prompts encoded and outputs decoded (plain when `drafter` is None).

    prompts: a string, a list of strings, a chat (a list of message dicts), or a list of chats. Chats are
    rendered with the tokenizer's chat template (with the assistant's header, and `chat_template_kwargs`);
    `chat=True` renders each string as one user message too. tokenizer: default, the one in the folder
    `target` was loaded from. stop_tokens: default, the tokenizer's `stop_tokens` (pass `()` for none).
    A row's text excludes the prompt and a final stop token's text; its `tokens` keep the stop token.
    Other keywords (`capacity`, `impl`, `verify_t`, `verify_buckets`) go to `generate`."""
    tok = _tokenizer_for(target, tokenizer)
    ids = _prompt_ids(tok, prompts, chat, chat_template_kwargs)
    stops = _default_stops(tok, target) if stop_tokens is None else stop_tokens
    out = api.generate(target, drafter, ids, max_new_tokens=max_new_tokens, stop_tokens=stops, sampling=sampling,
                       **generate_kwargs)
    ends = _stop_set(stops)
    return TextResult([_text(tok, row, ends) for row in out.tokens], out.tokens, out.stats)


def stream(target, drafter, prompt, *, tokenizer: Optional[Tokenizer] = None, max_new_tokens: int,
           stop_tokens=None, sampling: smp.Sampling | None = smp.Sampling(), chat: bool = False,
           chat_template_kwargs: Optional[dict] = None, burst: Optional[int] = None,
           **session_kwargs) -> Iterator[StreamChunk]:
    """Speculative generation of one prompt (a string or a chat), as text deltas per burst of a `Session`.

    Arguments as for `generate_text`; `burst` is the tokens per burst (default: the drafter's block size),
    other keywords go to `Session`. The prompt is checked and prefilled here, before the first chunk.
    Yields `StreamChunk`s whose texts join to exactly the output's text: a trailing incomplete multi-byte
    character is held back until the tokens completing it arrive. The last chunk has `finished` and the
    `Stats`."""
    if drafter is None:
        raise ValueError("stream runs a speculative Session and needs a drafter; for plain decoding use "
                         "generate_text(target, None, ...)")
    tok = _tokenizer_for(target, tokenizer)
    if not isinstance(prompt, str) and not (isinstance(prompt, (list, tuple)) and prompt
                                            and all(isinstance(m, Mapping) for m in prompt)):
        raise ValueError(f"stream takes one prompt: a string or a chat (a list of message dicts); got "
                         f"{prompt!r:.60}")
    ids = _prompt_ids(tok, prompt, chat, chat_template_kwargs)
    n = drafter.config.block_size if burst is None else integer("burst", burst, 1, "a positive integer or None")
    stops = _default_stops(tok, target) if stop_tokens is None else stop_tokens
    api.check_dtypes(target, drafter)
    session = Session(target, drafter, ids, max_new_tokens=max_new_tokens, stop_tokens=stops, sampling=sampling,
                      **session_kwargs)
    return _chunks(session, n, tok, _stop_set(stops))


def _chunks(session: Session, n: int, tok: Tokenizer, ends: set) -> Iterator[StreamChunk]:
    tokens, shown = [], ""
    while True:
        new = session.burst(n).tokens[0]
        tokens += new
        finished = session.finished
        text = _text(tok, tokens, ends)
        if not finished:
            text = text.rstrip("\ufffd")  # an incomplete multi-byte character decodes as U+FFFD: wait for the rest
        delta, shown = text[len(shown):], text
        yield StreamChunk(delta, new, finished, session.stats if finished else None)
        if finished:
            return


def _tokenizer_for(target, tokenizer: Optional[Tokenizer]) -> Tokenizer:
    if tokenizer is not None:
        if not isinstance(tokenizer, Tokenizer):
            raise ValueError(f"tokenizer must be a dflash_jax.Tokenizer (from load_tokenizer); got "
                             f"{type(tokenizer).__name__}")
        return tokenizer
    folder = api.source_folder(target)
    if folder is None:
        raise ValueError("tokenizer=None takes the tokenizer of the folder the target was loaded from, and this "
                         "target was not loaded by load_target: pass tokenizer=dflash_jax.load_tokenizer(path)")
    return _folder_tokenizer(folder)


@functools.lru_cache(maxsize=8)
def _folder_tokenizer(folder: str) -> Tokenizer:
    return load_tokenizer(folder)


def _prompt_ids(tok: Tokenizer, prompts, chat: bool, chat_kwargs: Optional[dict]) -> list:
    """Token ids per prompt. A string or a chat is one prompt; a list of them is a batch."""
    def is_chat(p):
        return isinstance(p, (list, tuple)) and bool(p) and all(isinstance(m, Mapping) for m in p)

    batch = [prompts] if isinstance(prompts, str) or is_chat(prompts) else prompts
    if not isinstance(batch, (list, tuple)) or not batch:
        raise ValueError(f"prompts must be a string, a chat (a list of message dicts), or a non-empty list of "
                         f"them; got {prompts!r:.60}")
    out = []
    for i, p in enumerate(batch):
        if isinstance(p, str) and not chat:
            ids = tok.encode(p)
        elif isinstance(p, str) or is_chat(p):
            ids = tok.encode_chat([{"role": "user", "content": p}] if isinstance(p, str) else p,
                                  **(chat_kwargs or {}))
        else:
            raise ValueError(f"prompt {i} is {p!r:.40}: expected a string or a chat (a list of message dicts); "
                             "for token ids use dflash_jax.generate")
        if not ids:
            raise ValueError(f"prompt {i} ({p!r:.40}) encodes to no tokens")
        out.append(ids)
    return out


def _default_stops(tok: Tokenizer, target) -> tuple:
    """The tokenizer's stop tokens, each refused unless the target can generate it."""
    vocab = target.config.vocab_size
    outside = [t for t in tok.stop_tokens if t >= vocab]
    if outside:
        raise CheckpointError(f"stop token {outside[0]} of the tokenizer in {tok.folder} (an eos_token_id of its "
                              f"generation_config.json or config.json, or its eos_token) is outside the target's "
                              f"vocabulary [0, {vocab}): pass stop_tokens= to choose others")
    return tok.stop_tokens


def _stop_set(stop_tokens) -> set:
    if stop_tokens is None:
        return set()
    return {int(stop_tokens)} if isinstance(stop_tokens, numbers.Integral) else {int(t) for t in stop_tokens}


def _text(tok: Tokenizer, tokens: list, ends: set) -> str:
    """The text of generated ids, without a final stop token."""
    return tok.decode(tokens[:-1] if tokens and tokens[-1] in ends else tokens)
