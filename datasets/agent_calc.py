"""The calculator task of ``configs/agent_calc.py``: the synthetic arithmetic examples of
``data.*`` (the training stream, and the held-out prompts of ``sources.load_eval``: distinct, none
of them trained on) written as JSONL whose answer field is a
tool-use trace, so the SFT warm start teaches the model to call the calculator:

    12*34=  ->  <tool_call>{"name":"calculator","arguments":{"expression":"12*34"}}</tool_call>
                <tool_response>408</tool_response>
                #### 408

Each line of the trace is one turn of the agent episode as the episode renders it for a
tokenizer without a chat template (``workflows/render.py``): the model's call ends with the
newline that ``agent.turn_stop`` makes a stop token, the tool response is the observation, and
the final turn is ``#### <answer>``. The math reward reads the ground truth after ``####`` and
the model's final number, so the same rows serve SFT (the whole trace is the target) and RL
(the reward compares the final answers).
"""

from __future__ import annotations

import json
import os
from typing import Any

from meshrl.configs.schema import DataConfig
from meshrl.datasets import sources

TRAIN_FILE, EVAL_FILE = "train.jsonl", "eval.jsonl"


def tool_call_text(name: str, arguments: dict[str, Any], tool_format: str = "hermes") -> str:
    """One call as the model writes it (compact JSON: fewer tokens to generate)."""
    if tool_format == "llama3":
        return json.dumps({"name": name, "parameters": arguments}, separators=(",", ":"))
    body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def trace(example: dict, tool_format: str = "hermes") -> str:
    """The tool-use trace answering ``example`` (``{"prompt": "12*34=", "answer": "408"}``)."""
    expression = example["prompt"].rstrip("=")
    call = tool_call_text("calculator", {"expression": expression}, tool_format)
    return (f"{call}\n<tool_response>{example['answer']}</tool_response>\n"
            f"#### {example['answer']}")


def write_task(data: DataConfig, directory: str | os.PathLike[str],
               tool_format: str = "hermes") -> tuple[str, str]:
    """(train path, held-out path): ``data``'s synthetic examples as trace rows, written
    atomically (a rerun rewrites the same bytes)."""
    os.makedirs(directory, exist_ok=True)
    out = []
    # The synthetic source's own split: the held-out prompts are distinct and none is trained.
    for name, rows in ((TRAIN_FILE, sources.load_train(data, {})),
                       (EVAL_FILE, sources.load_eval(data))):
        path = os.path.join(os.fspath(directory), name)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for ex in rows:
                f.write(json.dumps({"question": ex["prompt"],
                                    "answer": trace(ex, tool_format)}) + "\n")
        os.replace(tmp, path)
        out.append(path)
    return out[0], out[1]
