"""Prompt formats: the token ids of every fixed piece of an episode's context (docs/design.md §1–§2).

The compaction engine (:class:`crl.compaction.CompactionEngine`) assembles contexts from *pieces* — the
system prompt ``s``, the task ``u``, each action ``a_i`` and observation ``o_i``, the summary request ``q_sum``
and the resume template ``u_resume(S)`` — and tags every token with its piece's provenance. A
:class:`PromptFormat` supplies the ids of the non-sampled pieces:

* :class:`PlainFormat` (``prompt.format: plain``): the project's tagged protocol (:mod:`crl.prompts`), encoded
  with any ``encode``; exactly the ids the engine built before formats were pluggable.
* :class:`ChatFormat` (``prompt.format: chat``): the pieces rendered through a ``transformers`` tokenizer's
  chat template as system / user / assistant turns. With SmolLM2's ChatML template::

      <|im_start|>system\\n{system}<|im_end|>\\n                                   SYSTEM
      <|im_start|>user\\n{task}<|im_end|>\\n<|im_start|>assistant\\n                 TASK
      {action}<|im_end|>                                                          ACTION (sampled, mask 1)
      \\n<|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n        OBSERVATION
      ...
      <|im_end|>\\n<|im_start|>user\\n{summary instruction}<|im_end|>\\n<|im_start|>assistant\\n
                                                                                  SUMMARY_INSTRUCTION
      {summary}<|im_end|>                                                         SUMMARY (sampled, mask 1)

  and after a compaction ``SYSTEM`` + ``<|im_start|>user\\n{resume prefix}`` (RESUME_TEMPLATE) + the copied
  summary without its end-of-turn (COPIED_SUMMARY) + ``{resume suffix}<|im_end|>\\n<|im_start|>assistant\\n``
  (RESUME_TEMPLATE) + the copied tail. Template tokens belong to the turn they open or close; only the
  policy's sampled tokens — an action or a summary and the end-of-turn token that stops it — are trained.
  The context always ends with an open assistant turn (the generation prompt), so the summary request first
  closes that (empty) assistant turn; an action cut by its token budget has no end-of-turn, so the next
  observation closes the turn for it (``observation_ids(text, after_stop=False)``). Generation stops on the
  template's end-of-turn token (:attr:`ChatFormat.stop_id`).

Pieces are encoded one by one (``add_special_tokens=False``); special tokens split byte-level BPE, so the ids
equal the tokenization of the whole rendered conversation (tested against ``apply_chat_template``).
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

from crl import prompts

# Plain-language texts for chat-formatted episodes (the plain protocol's texts carry the project's own tags).
CHAT_SYSTEM_PROMPT = (
    "You are an agent working in a text console. Reply with exactly one command and nothing else. "
    "Commands: next (shows the next item), submit <answer> (ends the task with your answer)."
)
CHAT_SUMMARY_INSTRUCTION = (
    "The context is full. Write a short summary of every fact needed to finish the task. "
    "Reply with the summary only."
)
CHAT_RESUME_PREFIX = "Summary of earlier work:\n"  # the copied summary follows as tokens
CHAT_RESUME_SUFFIX = "\nContinue the task."

FORMATS = ("plain", "chat")


class PromptFormat(Protocol):
    """Token ids of the fixed pieces of a context; every method returns a fresh ``list[int]``."""

    def system_ids(self) -> list[int]:
        """``s``: the system prompt."""

    def task_ids(self, text: str) -> list[int]:
        """``u``: the task prompt (raw environment text), ending where the first action starts."""

    def observation_ids(self, text: str, after_stop: bool = True) -> list[int]:
        """``o_i`` (raw environment text) after an action; ``after_stop``: the action ended with the stop token."""

    def summary_request_ids(self) -> list[int]:
        """``q_sum``: appended to ``h_t`` to request the summary (Eq. 8)."""

    def resume_prefix_ids(self, after_task: bool = False) -> list[int]:
        """``u_resume`` before the copied summary; ``after_task``: follows the kept task prompt (keep_task_prompt)."""

    def resume_suffix_ids(self) -> list[int]:
        """``u_resume`` after the copied summary, ending where the next action (or the copied tail) starts."""


def _ints(ids) -> list[int]:
    return [int(t) for t in ids]


class PlainFormat:
    """The project's tagged protocol (:mod:`crl.prompts`) with any ``encode``: ``prompt.format: plain``."""

    def __init__(
        self,
        encode: Callable[[str], Sequence[int]],
        *,
        system_prompt: str = prompts.SYSTEM_PROMPT,
        summary_instruction: str = prompts.SUMMARY_INSTRUCTION,
        resume_prefix: str = prompts.RESUME_PREFIX,
        resume_suffix: str = prompts.RESUME_SUFFIX,
        format_task: Callable[[str], str] = prompts.format_task,
        format_observation: Callable[[str], str] = prompts.format_observation,
    ):
        self.encode = lambda text: _ints(encode(text))
        self.format_task, self.format_observation = format_task, format_observation
        self._system = self.encode(system_prompt)
        self._summary = self.encode(summary_instruction)
        self._prefix = self.encode(resume_prefix)
        self._suffix = self.encode(resume_suffix)

    def system_ids(self) -> list[int]:
        return list(self._system)

    def task_ids(self, text: str) -> list[int]:
        return self.encode(self.format_task(text))

    def observation_ids(self, text: str, after_stop: bool = True) -> list[int]:
        return self.encode(self.format_observation(text))

    def summary_request_ids(self) -> list[int]:
        return list(self._summary)

    def resume_prefix_ids(self, after_task: bool = False) -> list[int]:
        return list(self._prefix)

    def resume_suffix_ids(self) -> list[int]:
        return list(self._suffix)


class ChatTemplateError(ValueError):
    """A tokenizer whose chat template cannot be split into system / user / assistant turn pieces."""


class ChatFormat:
    """Pieces rendered through a ``transformers`` tokenizer's chat template: ``prompt.format: chat``.

    The template's turn boundaries are found by rendering a conversation of sentinel contents once
    (system, user, assistant, user + generation prompt) and splitting the text at the sentinels, so any
    template that renders turns as ``open + content + close`` (ChatML, Llama-3, Qwen, ...) works.

    Args:
        tokenizer: a ``transformers`` tokenizer with a ``chat_template``.
        stop_token: the end-of-turn token the policy emits (default: the first special token that closes an
            assistant turn in the template, e.g. ``<|im_end|>``); :attr:`stop_id` is its id.
        system_prompt / summary_instruction / resume_prefix / resume_suffix: the texts.
        task_template / observation_template: ``str.format`` templates with ``{task}`` / ``{observation}``.
        system_turn: ``"own"`` (a system turn holding ``system_prompt``) or ``"template"``: what the template itself
            renders before the first user turn of a conversation with no system message (SmolLM2: its built-in
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face", 21 tokens against the own turn's 48;
            ``system_prompt`` then unused). Refused when the template renders nothing there (``s`` must hold a token).
    """

    _SENTINELS = ("\u2983crl-system\u2984", "\u2983crl-user\u2984", "\u2983crl-assistant\u2984", "\u2983crl-user2\u2984")

    def __init__(
        self,
        tokenizer,
        *,
        stop_token: str | None = None,
        system_prompt: str = CHAT_SYSTEM_PROMPT,
        summary_instruction: str = CHAT_SUMMARY_INSTRUCTION,
        resume_prefix: str = CHAT_RESUME_PREFIX,
        resume_suffix: str = CHAT_RESUME_SUFFIX,
        task_template: str = "{task}",
        observation_template: str = "{observation}",
        system_turn: str = "own",
    ):
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(f"tokenizer {getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} has no chat template; use "
                                    "prompt.format=plain")
        self.tokenizer = tokenizer
        self.task_template, self.observation_template = task_template, observation_template
        t = self.turns = self._split_template(tokenizer, stop_token)
        self.stop_token = t["stop"]
        self.stop_id = int(tokenizer.convert_tokens_to_ids(self.stop_token))
        if self.encode(self.stop_token) != [self.stop_id]:
            raise ChatTemplateError(f"the end-of-turn {self.stop_token!r} is not a single token of this tokenizer")
        if system_turn == "own":
            self._system = self.encode(t["system_open"] + system_prompt + t["system_close"])
        elif system_turn == "template":
            self._system = self.encode(self._template_system_turn(tokenizer, t["user_open"]))
            if not self._system:
                raise ChatTemplateError("system_turn='template': this chat template renders no system turn for a conversation without one; "
                                        "use system_turn='own'")
        else:
            raise ChatTemplateError(f"system_turn={system_turn!r} is not 'own' or 'template'")
        close_assistant = t["stop"] + t["assistant_sep"]
        self._summary = self.encode(close_assistant + t["user_open"] + summary_instruction + t["user_close"] + t["generation"])
        self._prefix = self.encode(t["user_open"] + resume_prefix)
        self._prefix_after_task = self.encode(close_assistant + t["user_open"] + resume_prefix)
        self._suffix = self.encode(resume_suffix + t["user_close"] + t["generation"])

    def encode(self, text: str) -> list[int]:
        return _ints(self.tokenizer.encode(text, add_special_tokens=False))

    @classmethod
    def _split_template(cls, tok, stop_token: str | None) -> dict:
        S, U, A, O = cls._SENTINELS

        def render(messages, generation):
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

        msgs = [{"role": "system", "content": S}, {"role": "user", "content": U}, {"role": "assistant", "content": A},
                {"role": "user", "content": O}]
        try:
            full = render(msgs, True)
            sys_only = render(msgs[:1], False)
            two, two_gen = render(msgs[:2], False), render(msgs[:2], True)
        except Exception as err:
            raise ChatTemplateError(f"the chat template cannot render system/user/assistant turns: {type(err).__name__}: {err}") from None
        pos = [full.find(x) for x in (S, U, A, O)]
        if min(pos) < 0 or pos != sorted(pos) or not full.startswith(sys_only) or not two_gen.startswith(two) or not full.startswith(two):
            raise ChatTemplateError("the chat template does not render turns in order as prefixes of each other")
        system_open = full[: pos[0]]
        system_close = sys_only[pos[0] + len(S):]
        user_open = full[len(sys_only): pos[1]]
        generation = two_gen[len(two):]
        after_user = full[pos[1] + len(U): pos[2]]  # user_close + generation prompt
        if not after_user.endswith(generation):
            raise ChatTemplateError("the assistant turn does not start with the template's generation prompt")
        user_close = after_user[: len(after_user) - len(generation)]
        between = full[pos[2] + len(A): pos[3]]  # assistant close + user_open
        if not between.endswith(user_open) or full[pos[3] + len(O):] != user_close + generation:
            raise ChatTemplateError("user turns are not rendered identically throughout the conversation")
        assistant_close = between[: len(between) - len(user_open)]
        specials = sorted(getattr(tok, "all_special_tokens", []) + list(getattr(tok, "added_tokens_encoder", {}) or {}), key=len,
                          reverse=True)
        if stop_token is None:
            stop_token = next((s for s in specials if s and assistant_close.startswith(s)), None)
            if stop_token is None:
                raise ChatTemplateError(f"cannot find the end-of-turn token in the assistant close {assistant_close!r}; pass stop_token")
        if not assistant_close.startswith(stop_token):
            raise ChatTemplateError(f"the assistant turn closes with {assistant_close!r}, not with stop_token {stop_token!r}")
        return dict(
            system_open=system_open, system_close=system_close, user_open=user_open, user_close=user_close,
            generation=generation, stop=stop_token, assistant_sep=assistant_close[len(stop_token):],
        )

    @classmethod
    def _template_system_turn(cls, tok, user_open: str) -> str:
        """The text the template renders before the first user turn when the conversation has no system message."""
        U = cls._SENTINELS[1]
        text = tok.apply_chat_template([{"role": "user", "content": U}], tokenize=False, add_generation_prompt=False)
        head = text[: text.find(U)]
        if not head.endswith(user_open):
            raise ChatTemplateError("the chat template does not open the first user turn as it opens the others")
        return head[: len(head) - len(user_open)]

    # ------------------------------------------------------------------ PromptFormat
    def system_ids(self) -> list[int]:
        return list(self._system)

    def task_ids(self, text: str) -> list[int]:
        t = self.turns
        return self.encode(t["user_open"] + self.task_template.format(task=text) + t["user_close"] + t["generation"])

    def observation_ids(self, text: str, after_stop: bool = True) -> list[int]:
        t = self.turns
        close = t["assistant_sep"] if after_stop else t["stop"] + t["assistant_sep"]
        return self.encode(close + t["user_open"] + self.observation_template.format(observation=text) + t["user_close"] + t["generation"])

    def summary_request_ids(self) -> list[int]:
        return list(self._summary)

    def resume_prefix_ids(self, after_task: bool = False) -> list[int]:
        return list(self._prefix_after_task if after_task else self._prefix)

    def resume_suffix_ids(self) -> list[int]:
        return list(self._suffix)

    def messages_text(self, messages: list[dict], generation: bool = True) -> str:
        """The template's own rendering (for checks): ``apply_chat_template(..., tokenize=False)``."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def load_chat_tokenizer(path):
    """The ``transformers`` tokenizer of a local checkpoint directory (never downloads)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
