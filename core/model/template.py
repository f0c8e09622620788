"""Chat-template rendering for incremental turns.

The cache is never rebuilt from the transcript, so each new message is rendered as the text it *adds* to the
conversation: render(history + [message]) minus render(history). Only a short context (the system message and
the last exchange) is rendered, so the cost per turn does not grow with the chat.
"""

from __future__ import annotations

import torch

PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
# Models whose tokenizers ship without a chat template but are commonly chatted with through a plain one.
PLAIN_TEMPLATE_MODELS = {"gpt2"}

_S1, _S2, _S3 = "\x1fKVCHAT-A\x1f", "\x1fKVCHAT-B\x1f", "\x1fKVCHAT-C\x1f"


class TemplateError(ValueError):
    pass


class ChatFormat:
    def __init__(self, tokenizer, template: str):
        self.tokenizer = tokenizer
        self.template = template
        self.default_system = self._detect_default_system()
        self.closing = self._detect_closing()
        self._user_wrap: tuple[list[int], list[int]] | None = None
        added = {i: t for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                 if getattr(t, "special", False) and t.content}
        self.special_ids = frozenset(added)  # the template's own markers, as ids (the cache view draws them apart)
        self._specials = sorted({t.content for t in added.values()})  # and as text, to find them in a message

    @classmethod
    def for_model(cls, tokenizer, model_type: str, template: str | None = None) -> "ChatFormat":
        """``template``: None (the tokenizer's own), "plain", or Jinja source."""
        if template == "plain":
            return cls(tokenizer, PLAIN_TEMPLATE)
        if template:
            return cls(tokenizer, template)
        if tokenizer.chat_template:
            return cls(tokenizer, tokenizer.chat_template)
        if model_type in PLAIN_TEMPLATE_MODELS:
            return cls(tokenizer, PLAIN_TEMPLATE)
        raise TemplateError(
            "the model has no chat template; pass --chat-template plain or a Jinja template file"
        )

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    @staticmethod
    def _context(history: list[dict]) -> list[dict]:
        """The system message (if any) and the last exchange: enough for templates that render turn by turn."""
        head = history[:1] if history and history[0]["role"] == "system" else []
        tail = history[len(head) :][-2:]
        if tail and tail[0]["role"] != "user":
            tail = tail[1:]
        return head + tail

    def _diff(self, before: list[dict], after: list[dict], before_gp=False, after_gp=False) -> str:
        base = self.render(before, before_gp) if before else ""
        full = self.render(after, after_gp)
        if not full.startswith(base):
            raise TemplateError("the chat template re-renders earlier turns, so turns cannot be added incrementally")
        return full[len(base) :]

    def segment(self, history: list[dict], message: dict) -> str:
        """The text that appending ``message`` to ``history`` adds (for an assistant message: header included)."""
        ctx = self._context(history)
        return self._diff(ctx, ctx + [message])

    def segment_parts(self, history: list[dict], message: dict) -> list[tuple[str, bool]]:
        """``segment(history, message)`` as (text, plain) parts: the template's own text, read with its special
        tokens, and the message's content, read as plain text (``plain``), so that a message quoting "<|im_end|>"
        or "<|endoftext|>" reads as those characters and ends neither itself nor the text (as llama.cpp reads typed
        text unless told otherwise). One part, read as the template's, where the content holds no special token's
        text, or where the template renders it inside text of its own."""
        seg = self.segment(history, message)
        if any(s in message["content"] for s in self._specials):
            head, found, tail = self.segment(history, {**message, "content": _S1}).partition(_S1)
            if found and _S1 not in tail and seg.startswith(head) and seg.endswith(tail) \
                    and len(seg) >= len(head) + len(tail):
                return [(head, False), (seg[len(head):len(seg) - len(tail)], True), (tail, False)]
        return [(seg, False)]

    def generation_header(self, history: list[dict]) -> str:
        """The text that opens an assistant reply after ``history`` (the generation prompt)."""
        ctx = self._context(history)
        return self._diff(ctx, ctx, before_gp=False, after_gp=True)

    def user_wrap(self) -> tuple[list[int], list[int]]:
        """The token ids a user message's content sits between in a running chat (its header, its end marker),
        computed once."""
        if self._user_wrap is None:
            seg = self.segment([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
                               {"role": "user", "content": _S1})
            head, _, tail = seg.partition(_S1)
            ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] if t else [] for t in (head, tail)]
            self._user_wrap = (ids[0], ids[1])
        return self._user_wrap

    def _detect_default_system(self) -> str | None:
        """The system prompt the template inserts when a conversation has none (SmolLM2 does), or None."""
        try:
            bare = self.render([{"role": "user", "content": _S1}])
            with_sys = self.render([{"role": "system", "content": _S2}, {"role": "user", "content": _S1}])
        except Exception:
            return None
        if _S2 not in with_sys:
            return None
        pre, post = with_sys.split(_S2, 1)
        if bare.startswith(pre) and bare.endswith(post) and len(bare) > len(pre) + len(post):
            return bare[len(pre) : len(bare) - len(post)]
        return None

    def _detect_closing(self) -> str:
        """The text a template puts after an assistant message's content (e.g. "<|im_end|>\\n")."""
        msgs = [{"role": "user", "content": _S1}, {"role": "assistant", "content": _S2}]
        try:
            text = self.render(msgs)
        except Exception as exc:  # a template that cannot render a plain exchange is unusable
            raise TemplateError(f"the chat template cannot render a conversation: {exc}") from None
        return text.split(_S2, 1)[1] if _S2 in text else ""


def scaffolding(chat: ChatFormat, tokenizer) -> torch.Tensor:
    """Token ids the chat template wraps every message in (role headers, end markers): a group made of these alone
    carries nothing to recall."""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids = set(tokenizer.all_special_ids)
    for role in ("user", "assistant"):
        marker = "xq"
        seg = chat.segment([{"role": "user", "content": "hi"}] if role == "assistant" else [],
                           {"role": role, "content": marker})
        head, _, tail = seg.partition(marker)
        ids |= set(encode(head)) | set(encode(tail))
    return torch.tensor(sorted(ids), dtype=torch.long)
