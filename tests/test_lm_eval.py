"""lm-evaluation-harness (the release pinned in pyproject's test extras) against `unikern
serve`: its own `local-completions` model over /v1/completions runs a loglikelihood
(multiple-choice) task and a generate-until task, both defined here in YAML over local
JSON files (no hub). Each loglikelihood it got equals mlx-lm's own for that continuation
within 1e-4 (lm-eval reads them from `echo` + `logprobs`), and each generation is the text
the server gives the same prompt (so exact_match is 1). docs/evaluation.md says how to run it."""

from __future__ import annotations

import json
import textwrap
import warnings

import httpx
import numpy as np
import pytest

from tests.test_http_serve import Served
from tests.test_prompt_logprobs import reference

TOLERANCE = 1e-4
CHOICES = [
    ("def add(a, b):\n    return a", [" + b", " - b", " * b"]),
    ("for i in range(", ["10):", "len(x)):", "n)"]),
    ("import numpy as", [" np", " pd"]),
    ("The cat sat on the", [" mat", " moon", " dog"]),
]
PROMPTS = ["def add(a, b):", "x = 1\ny =", "print("]
MAX_GEN_TOKENS = 6

MC_TASK = """
task: unikern_smoke_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

GEN_TASK = """
task: unikern_smoke_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: {max_gen}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("lm-eval") / "serve.log"
    served = Served(["--model", tiny_llama, "--port", "0", "--set", "kv.kv_budget_bytes=67108864"], log)
    try:
        served.wait_ready()
        yield served
    finally:
        if served.process.poll() is None:
            served.process.terminate()
            served.process.wait(timeout=60)


def write_tasks(folder, targets: list[str]) -> None:
    mc = [{"question": q, "choices": c, "answer": 0} for q, c in CHOICES]
    gen = [{"prompt": p, "target": t} for p, t in zip(PROMPTS, targets, strict=True)]
    for name, docs, task in (("mc", mc, MC_TASK), ("gen", gen, GEN_TASK)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (folder / f"{name}.yaml").write_text(textwrap.dedent(task.format(data=data, max_gen=MAX_GEN_TOKENS)))


def test_lm_eval_runs_loglikelihood_and_generate_until(server, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    with warnings.catch_warnings():  # lm-eval's and its libraries' own warnings are not ours to fail on
        warnings.simplefilter("ignore")
        import lm_eval
        from lm_eval.models.openai_completions import LocalCompletionsAPI
        from lm_eval.tasks import TaskManager

        lm = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model="tiny", tokenizer=tiny_llama,
                                 tokenizer_backend="huggingface", max_retries=1)
        # the generations' expected text: the server's own greedy answer to each prompt's tokens
        targets = []
        for prompt in PROMPTS:
            body = {"model": "tiny", "prompt": lm.tok_encode(prompt), "max_tokens": MAX_GEN_TOKENS, "temperature": 0,
                    "stop": ["\n\n"]}
            targets.append(httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"])
        write_tasks(tmp_path, targets)
        tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)
        out = lm_eval.simple_evaluate(model=lm, tasks=["unikern_smoke_mc", "unikern_smoke_gen"], task_manager=tasks,
                                      log_samples=True)
    results = out["results"]
    assert 0.0 <= results["unikern_smoke_mc"]["acc,none"] <= 1.0
    assert results["unikern_smoke_gen"]["exact_match,none"] == 1.0, out["samples"]["unikern_smoke_gen"]
    samples = sorted(out["samples"]["unikern_smoke_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(CHOICES)
    for (question, choices), sample in zip(CHOICES, samples, strict=True):
        for choice, (got, greedy) in zip(choices, sample["filtered_resps"], strict=True):
            context, continuation = lm._encode_pair(question, choice)
            tokens = context + continuation
            ref = reference(tiny_llama, tokens)
            theirs = [ref[len(context) - 1 + i] for i in range(len(continuation))]
            expected = sum(float(dist[t]) for dist, t in zip(theirs, continuation, strict=True))
            assert abs(float(got) - expected) < TOLERANCE, (question, choice, got, expected)
            assert greedy == all(int(np.argmax(dist)) == t for dist, t in zip(theirs, continuation, strict=True))
