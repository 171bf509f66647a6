"""An environment written only against the documented API (docs/agents.md): no meshrl import.

The model answers an arithmetic prompt; a wrong first answer gets a hint and a second try."""

from __future__ import annotations


class RetryEnv:
    async def reset(self, example: dict) -> str | None:
        self.answer = str(example["answer"])
        self.turn = 0
        return None  # the prompt says all

    async def step(self, action: str) -> tuple[str | None, float | None, bool]:
        self.turn += 1
        if action.strip() == self.answer:
            return None, 1.0 if self.turn == 1 else 0.5, True
        if self.turn == 1:
            return f"no, {len(self.answer)} digits", 0.0, False
        return None, 0.0, True


def make() -> RetryEnv:
    return RetryEnv()
