"""Chat rendering and the built-in word-level tokenizer.

The built-in tokenizer is an ordinary ``transformers.PreTrainedTokenizerFast`` made with ``tokenizers``
(WordLevel model, split on whitespace then on every punctuation character) and a ChatML-style chat
template, so the engine renders prompts and tool observations through ``apply_chat_template`` exactly as
it does for a real checkpoint with its own tokenizer.
"""

from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
ROLES = ["system", "user", "assistant", "tool"]

# ChatML-like, with spaces instead of newlines because the word-level tokenizer splits on whitespace.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def build_word_tokenizer(words: Iterable[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``words`` (plus roles and special tokens) with the chat template."""
    vocab: dict[str, int] = {}
    for w in [*SPECIAL, *ROLES, *sorted(set(words))]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated")]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token=None,
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


class ChatRenderer:
    """Token-level chat rendering: prompts, tool-observation suffixes, hint messages, end of turn.

    Suffixes are computed TRL-style, as the difference between the template applied with and without the
    extra message, so any chat template works without knowing its format.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tok = tokenizer
        if tokenizer.eos_token_id is None:
            raise ValueError("tokenizer has no eos_token: set one to mark the end of an assistant turn")
        self.end_of_turn = int(tokenizer.eos_token_id)
        self.pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.end_of_turn)
        # A fixed conversation whose suffix diffs are taken; its content never reaches the model.
        self._dummy = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]
        self._dummy_ids = self._ids(self._dummy, generation_prompt=False)
        # What the template writes after an assistant turn's end-of-turn token and before the next message
        # (Qwen's "\n" after <|im_end|>): the engine samples up to end-of-turn, so these tokens open every suffix.
        if self.end_of_turn not in self._dummy_ids:
            raise ValueError(f"the chat template does not end an assistant turn with the tokenizer's eos_token "
                             f"({tokenizer.eos_token!r}); set eos_token to the template's end-of-turn token")
        last = len(self._dummy_ids) - 1 - self._dummy_ids[::-1].index(self.end_of_turn)
        self._after_turn = self._dummy_ids[last + 1:]
        self._prompts: dict = {}
        self._suffixes: dict[tuple[str, str | None], list[int]] = {}
        # Does the template list tools? SmolLM2's, like many, renders none: then they go into the system message.
        probe = [{"type": "function", "function": {"name": "rail_probe_tool", "description": "probe",
                                                    "parameters": {"type": "object", "properties": {}}}}]
        try:
            shown = self.tok.apply_chat_template(self._dummy[:1], tokenize=False, tools=probe)
        except Exception:  # noqa: BLE001 - a template that fails on tools= lists none
            shown = ""
        self.lists_tools = "rail_probe_tool" in str(shown)

    def _ids(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None,
             describe: bool = False) -> list[int]:
        if tools and describe and not self.lists_tools:
            messages = [dict(messages[0], content=messages[0]["content"] + "\n\n" + tools_block(tools)),
                        *messages[1:]] if messages and messages[0]["role"] == "system" else \
                [{"role": "system", "content": tools_block(tools)}, *messages]
            tools = None
        kw = {"tools": tools} if tools else {}
        out = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt, **kw)
        if isinstance(out, dict) or hasattr(out, "keys"):  # BatchEncoding in newer transformers
            out = out["input_ids"]
        return list(out)

    def _prompt_ids(self, messages: list[dict], tools: list[dict] | None, describe: bool = False) -> list[int]:
        """Prompts repeat (a group shares its task's), and rendering a template that lists tools is not free."""
        key = (tuple((m["role"], m["content"]) for m in messages), id(tools) if tools else None, describe)
        if key not in self._prompts:
            if len(self._prompts) >= 512:  # a step's groups share few prompts; BFCL's run to thousands of tokens
                self._prompts.clear()
            self._prompts[key] = (self._ids(messages, generation_prompt=True, tools=tools, describe=describe), tools)
        return list(self._prompts[key][0])

    def prompt(self, system: str, user: str, tools: list[dict] | None = None, describe: bool = False) -> list[int]:
        """The prompt tokens, ending with the assistant generation header; ``tools`` (JSON schemas) are listed
        the way the template lists them (the built-in template lists none). ``describe``: the tool format needs
        the schemas (hermes, json), so a template that lists none gets them in the system message
        (:func:`tools_block`)."""
        return self._prompt_ids([{"role": "system", "content": system}, {"role": "user", "content": user}], tools,
                                describe)

    def tool_suffix(self, observation: str, user: str | None = None) -> list[int]:
        """Tokens after an assistant turn's end: the tool message and the next assistant header. ``user``: the
        environment went on to its next user message instead (a conversation of several user turns), which
        takes the tool message's place.

        Observations repeat (an entity, a number, an error message) and rendering the template is a good part of
        a rollout's time on a small model, so suffixes are kept like prompts."""
        key = (observation, user)
        if key not in self._suffixes:
            if len(self._suffixes) >= 4096:
                self._suffixes.clear()
            self._suffixes[key] = self._suffix_many(_after_turn(observation, user))
        return list(self._suffixes[key])

    def _suffix_many(self, messages: list[dict]) -> list[int]:
        full = self._ids([*self._dummy, *messages], generation_prompt=True)
        if full[: len(self._dummy_ids)] != self._dummy_ids:
            raise ValueError("chat template is not prefix-stable; cannot render tool messages incrementally")
        return self._after_turn + full[len(self._dummy_ids):]

    def tool_suffix_with_hint(self, observation: str, hint: str, user: str | None = None) -> tuple[list[int], int, int]:
        """The tool suffix with a user hint message after the tool message (or after ``user``'s message).

        Returns ``(ids, start, end)``: ``ids[start:end]`` are the hint's tokens (guidance); removing them gives
        exactly :meth:`tool_suffix`.
        """
        base = self.tool_suffix(observation, user)
        full = self._suffix_many([*_after_turn(observation, user), {"role": "user", "content": hint}])
        start, end = split_inserted(base, full)
        return full, start, end

    def prompt_with_hint(self, system: str, user: str, hint: str, tools: list[dict] | None = None,
                         describe: bool = False) -> tuple[list[int], list[int]]:
        """(prompt as sampled with a hint message after the user message, prompt without it)."""
        base = self.prompt(system, user, tools, describe)
        full = self._prompt_ids(
            [{"role": "system", "content": system}, {"role": "user", "content": user},
             {"role": "user", "content": hint}], tools, describe)
        split_inserted(base, full)  # raises if the hint is not a clean insertion
        return full, base

    def encode_turn(self, text: str) -> list[int]:
        """Token ids of an assistant turn's text (without the end-of-turn token)."""
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def tools_block(tools: list[dict]) -> str:
    """The tools, described in the system message for a chat template that lists none: their JSON schemas and
    how to call one, in the ``hermes`` tool format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    which ``rollout.tool_format = "hermes"`` parses; docs/models.md)."""
    import json

    schemas = "\n".join(json.dumps(t, separators=(", ", ": ")) for t in tools)
    return ("# Tools\n\nYou can call these functions. Their signatures, one JSON schema per line, between <tools> "
            f"and </tools>:\n<tools>\n{schemas}\n</tools>\n\nTo call one, write a JSON object with its name and "
            "arguments between <tool_call> and </tool_call>:\n<tool_call>\n{\"name\": <function name>, "
            "\"arguments\": <arguments as a JSON object>}\n</tool_call>")


def _after_turn(observation: str, user: str | None) -> list[dict]:
    """The message that follows an assistant turn: the tool's observation, or the next user message."""
    return [{"role": "user", "content": user}] if user is not None else [{"role": "tool", "content": observation}]


def split_inserted(base: list[int], with_extra: list[int]) -> tuple[int, int]:
    """Where ``with_extra`` differs from ``base`` when extra messages were inserted into a conversation.

    Returns ``(start, end)`` such that ``with_extra[:start] + with_extra[end:] == base``: the common prefix
    and common suffix are shared; ``with_extra[start:end]`` is what the insertion added.
    """
    n = 0
    while n < min(len(base), len(with_extra)) and base[n] == with_extra[n]:
        n += 1
    m = 0
    while m < min(len(base), len(with_extra)) - n and base[-1 - m] == with_extra[-1 - m]:
        m += 1
    if n + m != len(base):
        raise ValueError("inserting a message changed the rest of the rendering; cannot mark it as guidance")
    return n, len(with_extra) - m
