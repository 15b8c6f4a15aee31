"""Multiple-choice tasks with lm-evaluation-harness's own prompt and target strings.

Each task turns one dataset record into a Request set exactly as lm-evaluation-harness does
(EleutherAI/lm-evaluation-harness at 4e7e0d47f33bc71070c1d38394bafbb52b117163, lm_eval 0.4.13):
its `lm_eval/tasks/<task>/*.yaml` doc_to_text / doc_to_choice / doc_to_target (Jinja there,
the same strings here), `lm_eval/tasks/hellaswag/utils.py` (preprocess),
`lm_eval/tasks/winogrande/preprocess_winogrande.py`, `lm_eval/tasks/mmlu/_generate_configs.py`
(description) and `lm_eval/api/task.py` (fewshot_context / build_qa_turn / construct_requests):

- the continuation of choice c is target_delimiter (" ") + c;
- few-shot examples (MMLU only, `first_n` from the dev split of the same subject) are
  doc_to_text + " " + the gold choice + "\\n\\n", after the description;
- winogrande has "multiple inputs": each choice is a context (the sentence up to the blank,
  the option filled in), and the continuation (the rest of the sentence) is shared.

Metrics follow each task's metric_list: acc everywhere, acc_norm where the yaml lists it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from colibri.eval.data import EvalError

TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"


@dataclass(frozen=True)
class Request:
    """One item's strings. contexts[i] / continuations[i]: the pair scored for choice i (the
    continuation's log-likelihood given the context); choices[i]: the choice string whose
    length in characters normalises acc_norm; gold: the index of the right choice."""

    contexts: list[str]
    continuations: list[str]
    choices: list[str]
    gold: int


def _get(doc: Mapping[str, Any], name: str, where: str) -> Any:
    if name not in doc:
        raise EvalError(f"{where}: field {name!r} is missing (fields: {', '.join(sorted(doc))})")
    return doc[name]


def _str(doc: Mapping[str, Any], name: str, where: str) -> str:
    v = _get(doc, name, where)
    if not isinstance(v, str):
        raise EvalError(f"{where}: field {name!r} must be a string, not {type(v).__name__}")
    return v


def _strs(v: Any, name: str, where: str) -> list[str]:
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(s, str) for s in v):
        raise EvalError(f"{where}: field {name!r} must be a non-empty list of strings")
    return list(v)


def _index(v: Any, n: int, name: str, where: str) -> int:
    try:
        i = int(v)
    except (TypeError, ValueError):
        raise EvalError(f"{where}: field {name!r} = {v!r} is not an index") from None
    if not 0 <= i < n:
        raise EvalError(f"{where}: field {name!r} = {v!r} is out of range for {n} choices")
    return i


def _labelled(doc: Mapping[str, Any], key: str, where: str) -> tuple[list[str], int]:
    """ARC / OpenBookQA: choices {"text": [...], "label": [...]} and the gold label in key."""
    choices = _get(doc, "choices", where)
    if not isinstance(choices, Mapping) or "text" not in choices or "label" not in choices:
        raise EvalError(f"{where}: field 'choices' must be {{'text': [...], 'label': [...]}}")
    text = _strs(choices["text"], "choices.text", where)
    labels = [str(x) for x in choices["label"]]
    answer = str(_get(doc, key, where)).lstrip()
    if answer not in labels:
        raise EvalError(f"{where}: field {key!r} = {answer!r} is not among labels {labels}")
    return text, labels.index(answer)


def _plain(context: str, choices: list[str], gold: int) -> Request:
    return Request([context] * len(choices), [TARGET_DELIMITER + c for c in choices], choices, gold)


def hellaswag_preprocess(text: str) -> str:
    """lm_eval/tasks/hellaswag/utils.py preprocess()."""
    text = text.strip()
    # NOTE: Brackets are artifacts of the WikiHow dataset portion of HellaSwag.
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def _arc(doc: Mapping[str, Any], where: str) -> Request:
    text, gold = _labelled(doc, "answerKey", where)
    return _plain(f"Question: {_str(doc, 'question', where)}\nAnswer:", text, gold)


def _hellaswag(doc: Mapping[str, Any], where: str) -> Request:
    ctx = _str(doc, "ctx_a", where) + " " + _str(doc, "ctx_b", where).capitalize()
    query = hellaswag_preprocess(_str(doc, "activity_label", where) + ": " + ctx)
    endings = _strs(_get(doc, "endings", where), "endings", where)
    choices = [hellaswag_preprocess(e) for e in endings]
    return _plain(query, choices, _index(_get(doc, "label", where), len(choices), "label", where))


def _piqa(doc: Mapping[str, Any], where: str) -> Request:
    choices = [_str(doc, "sol1", where), _str(doc, "sol2", where)]
    gold = _index(_get(doc, "label", where), 2, "label", where)
    return _plain(f"Question: {_str(doc, 'goal', where)}\nAnswer:", choices, gold)


def _winogrande(doc: Mapping[str, Any], where: str) -> Request:
    sentence = _str(doc, "sentence", where)
    if "_" not in sentence:
        raise EvalError(f"{where}: field 'sentence' has no blank '_'")
    idx = sentence.index("_")
    options = [_str(doc, "option1", where), _str(doc, "option2", where)]
    answer = str(_get(doc, "answer", where))
    if answer not in ("1", "2"):
        raise EvalError(f"{where}: field 'answer' = {answer!r} must be '1' or '2'")
    contexts = [sentence[:idx] + opt for opt in options]  # doc_to_choice
    target = sentence[idx + 1 :].strip()  # doc_to_target
    return Request(contexts, [TARGET_DELIMITER + target] * 2, contexts, int(answer) - 1)


def _boolq(doc: Mapping[str, Any], where: str) -> Request:
    text = f"{_str(doc, 'passage', where)}\nQuestion: {_str(doc, 'question', where)}?\nAnswer:"
    if "label" in doc:  # super_glue/boolq (lm-eval's dataset)
        gold = _index(doc["label"], 2, "label", where)
    else:  # google/boolq spells it answer: true / false
        answer = _get(doc, "answer", where)
        if not isinstance(answer, bool):
            raise EvalError(f"{where}: field 'answer' must be true or false")
        gold = int(answer)
    return _plain(text, ["no", "yes"], gold)


def _sciq(doc: Mapping[str, Any], where: str) -> Request:
    text = (
        f"{_str(doc, 'support', where).lstrip()}\nQuestion: {_str(doc, 'question', where)}\nAnswer:"
    )
    names = ("distractor1", "distractor2", "distractor3", "correct_answer")
    return _plain(text, [_str(doc, n, where) for n in names], 3)


def _openbookqa(doc: Mapping[str, Any], where: str) -> Request:
    text, gold = _labelled(doc, "answerKey", where)
    return _plain(_str(doc, "question_stem", where), text, gold)


MMLU_CHOICES = ["A", "B", "C", "D"]


def mmlu_text(doc: Mapping[str, Any], where: str) -> str:
    """lm_eval/tasks/mmlu/default/_default_template_yaml doc_to_text."""
    choices = _strs(_get(doc, "choices", where), "choices", where)
    if len(choices) != 4:
        raise EvalError(f"{where}: field 'choices' must have 4 entries, not {len(choices)}")
    lines = [_str(doc, "question", where).strip()]
    lines += [f"{letter}. {c}" for letter, c in zip(MMLU_CHOICES, choices, strict=True)]
    return "\n".join(lines) + "\nAnswer:"


def mmlu_description(subject: str) -> str:
    """lm_eval/tasks/mmlu/_generate_configs.py's description of a subject."""
    return (
        "The following are multiple choice questions (with answers) about "
        f"{' '.join(subject.split('_'))}.\n\n"
    )


def _mmlu(doc: Mapping[str, Any], where: str, shots: Sequence[Mapping[str, Any]] = ()) -> Request:
    subject = _str(doc, "subject", where)
    context = mmlu_description(subject)
    for j, shot in enumerate(shots):
        w = f"{where} (few-shot example {j})"
        gold = _index(_get(shot, "answer", w), 4, "answer", w)
        context += mmlu_text(shot, w) + TARGET_DELIMITER + MMLU_CHOICES[gold] + FEWSHOT_DELIMITER
    context += mmlu_text(doc, where)
    gold = _index(_get(doc, "answer", where), 4, "answer", where)
    return _plain(context, list(MMLU_CHOICES), gold)


@dataclass(frozen=True)
class Task:
    """name; build(doc, where) -> Request; metrics: those of the task's metric_list."""

    name: str
    build: Callable[..., Request]
    metrics: tuple[str, ...] = ("acc", "acc_norm")
    fewshot: bool = False


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("arc_easy", _arc),
        Task("arc_challenge", _arc),
        Task("hellaswag", _hellaswag),
        Task("mmlu", _mmlu, ("acc",), fewshot=True),
        Task("piqa", _piqa),
        Task("winogrande", _winogrande, ("acc",)),
        Task("boolq", _boolq, ("acc",)),
        Task("sciq", _sciq),
        Task("openbookqa", _openbookqa),
    )
}


def build_requests(
    task: str,
    docs: Sequence[Mapping[str, Any]],
    source: str,
    *,
    shots: int = 0,
    fewshot_docs: Sequence[Mapping[str, Any]] = (),
    fewshot_source: str = "",
) -> list[Request]:
    """Requests of every doc (docs from `source`, named in errors as source:item N).

    shots: few-shot examples per item (MMLU only: the first `shots` records of fewshot_docs
    with the item's subject, lm-eval's first_n sampler on the dev split). Raises EvalError
    (unknown task, bad shots, missing or malformed fields)."""
    if task not in TASKS:
        raise EvalError(f"unknown task {task!r} (choose from perplexity, {', '.join(TASKS)})")
    t = TASKS[task]
    if not 0 <= shots <= 5:
        raise EvalError(f"--shots {shots}: must be 0..5")
    if shots and not t.fewshot:
        raise EvalError(f"--shots: task {task} is evaluated zero-shot here (mmlu takes shots)")
    by_subject: dict[str, list[Mapping[str, Any]]] = {}
    if shots:
        for j, d in enumerate(fewshot_docs):
            by_subject.setdefault(_str(d, "subject", f"{fewshot_source}:item {j}"), []).append(d)
    out = []
    for i, doc in enumerate(docs):
        where = f"{source}:item {i}"
        if shots:
            subject = _str(doc, "subject", where)
            examples = by_subject.get(subject, [])[:shots]
            if len(examples) < shots:
                raise EvalError(
                    f"{fewshot_source}: {len(examples)} examples of subject {subject!r}, "
                    f"--shots {shots} needs {shots}"
                )
            out.append(t.build(doc, where, examples))
        else:
            out.append(t.build(doc, where))
    return out
