"""slimact under the fine-tuning stack: ``transformers.Trainer`` with ``SlimactCallback``, TRL's
``SFTTrainer``, peft LoRA, and a plain accelerate loop.

Each run trains a tiny random Llama a few steps on ragged, right-padded batches
(``attention_mask``, ``-100`` labels) under bf16 autocast with gradient accumulation 2 (so
``Trainer`` passes ``num_items_in_batch``), and its logged losses follow the run without
slimact: the first step's exactly for every strategy (the forward is unchanged), the later ones
to 1e-5 relative for the exact strategies and within a bound for the approximate ones. The
callback's measured saved bytes show the strategy acted."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

import slimact
from slimact import hf
from slimact.patching import overrides
from slimact.planner.auto import AutoConfig

transformers = pytest.importorskip("transformers")

V = 128
EXACT = ("none", "recompute", "chunked-ce")
# codecs decode lossy gradients; invact inverts its activations from their bf16 outputs
APPROX = ("invact", "int4", "int8", "auto@50%")
APPROX_RTOL = 1e-3  # the loss after one update from approximate gradients


@pytest.fixture(autouse=True)
def _fresh_accelerate():
    """Each Trainer starts from, and leaves, no process-wide accelerate state (a bf16 run's
    mixed precision would otherwise reach the next Accelerator made in this process)."""
    state = pytest.importorskip("accelerate").state
    state.AcceleratorState._reset_state(reset_partial_state=True)
    yield
    state.AcceleratorState._reset_state(reset_partial_state=True)


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _rows(n: int = 8) -> list[list[int]]:
    """Token rows of 5 to 16 tokens (ragged: every batch is padded)."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(5, 17, (n,), generator=g).tolist()
    return [torch.randint(2, V, (k,), generator=g).tolist() for k in lengths]


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i]}


def _collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded ids, their attention mask, and the labels: the ids, -100 on padding."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _args(cls, steps: int, **extra):
    return cls(
        per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=steps, learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True,
        bf16=True, save_strategy="no", disable_tqdm=True, seed=0, **extra,
    )  # fmt: skip


def _losses(trainer) -> list[float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF deprecations, slimact's one-time notes
        trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _spec(strategy: str, cache) -> str | AutoConfig:
    """``auto@50%`` timing one repeat per candidate (the plan's choices, not its timings, are
    under test here), its profile cached under ``cache``."""
    if strategy == "auto@50%":
        return AutoConfig(budget="50%", repeats=1, cache=str(cache))
    return strategy


def _follows(losses: list[float], base: list[float], strategy: str) -> None:
    assert len(losses) == len(base) and all(map(torch.isfinite, torch.tensor(losses)))
    rel = torch.tensor(losses).sub(torch.tensor(base)).abs().div(torch.tensor(base).abs())
    assert rel[0] <= 1e-5, (strategy, losses, base)  # the first step: the same forward
    bound = 1e-5 if strategy in EXACT else APPROX_RTOL
    assert rel.max() <= bound, (strategy, losses, base)


def _trainer(model, tmp_path, callbacks=(), steps: int = 2):
    args = _args(transformers.TrainingArguments, steps, output_dir=str(tmp_path))
    return transformers.Trainer(
        model=model, args=args, train_dataset=_Rows(_rows()), data_collator=_collate,
        callbacks=list(callbacks),
    )  # fmt: skip


@pytest.fixture(scope="module")
def trainer_base(tmp_path_factory):
    """The run without slimact's callback (its losses), and the callback's ``none`` run (the
    saved bytes of its first step, which nothing changes)."""
    losses = _losses(_trainer(_llama(), tmp_path_factory.mktemp("base")))
    cb = hf.SlimactCallback("none")
    _follows(_losses(_trainer(_llama(), tmp_path_factory.mktemp("none"), [cb])), losses, "none")
    return losses, cb.saved_bytes


@pytest.mark.parametrize("strategy", [*EXACT[1:], *APPROX])
def test_trainer_callback(strategy, trainer_base, tmp_path, monkeypatch):
    """``Trainer`` (bf16, gradient accumulation 2, ``num_items_in_batch``) with the callback:
    the losses follow the run without slimact and the first step saves less."""
    monkeypatch.setenv("SLIMACT_CACHE", str(tmp_path / "cache"))
    base, base_bytes = trainer_base
    model = _llama()
    cb = hf.SlimactCallback(_spec(strategy, tmp_path))
    losses = _losses(_trainer(model, tmp_path, [cb]))
    _follows(losses, base, strategy)
    assert cb.saved_bytes < base_bytes, (strategy, cb.saved_bytes, base_bytes)
    assert not slimact.applied(model) and not overrides(model)  # reverted at train end


def test_trainer_num_items_reach_the_chunked_head(tmp_path, monkeypatch):
    """The Trainer passes ``num_items_in_batch`` under gradient accumulation (one count for
    the step's micro-batches); the patched head computes its loss with it (sum / items)."""
    from slimact import sites
    from slimact.reformulate import head

    seen: list = []
    chunked_loss = head._chunked_loss

    def spy(state, job, x):
        if not sites.is_probing():
            seen.append(job["num_items"])
        return chunked_loss(state, job, x)

    monkeypatch.setattr(head, "_chunked_loss", spy)
    _losses(_trainer(_llama(), tmp_path, [hf.SlimactCallback("chunked-ce")], steps=1))
    assert len(seen) == 2 and seen[0] is not None and int(seen[0]) == int(seen[1]) > 0, seen


def test_peft_lora_with_trainer(tmp_path):
    """The README's peft recipe: LoRA, ``slimact.apply``, ``Trainer``: the losses are the
    LoRA model's own."""
    peft = pytest.importorskip("peft")

    def lora():
        torch.manual_seed(1)
        cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        return peft.get_peft_model(_llama(), cfg)

    base = _losses(_trainer(lora(), tmp_path / "a"))
    model = slimact.apply(lora(), "chunked-ce")
    (row,) = [c for c in slimact.applied(model) if c.action == "chunked-ce"]
    assert not row.skipped, row
    _follows(_losses(_trainer(model, tmp_path / "b")), base, "chunked-ce")


# ----------------------------------------------------------------------------- TRL
def _tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"t{i}": i for i in range(V)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t1"
    )


def _sft(model, tmp_path, callbacks=(), steps: int = 2):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict({"input_ids": _rows(4 * steps)})
    args = _args(trl.SFTConfig, steps, output_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trl.SFTTrainer(
            model=model, args=args, train_dataset=data, processing_class=_tokenizer(),
            callbacks=list(callbacks),
        )  # fmt: skip


@pytest.fixture(scope="module")
def sft_base(tmp_path_factory):
    return _losses(_sft(_llama(), tmp_path_factory.mktemp("sft")))


@pytest.mark.parametrize("strategy", ["chunked-ce", "int8", "auto@50%"])
def test_sft_trainer_callback(strategy, sft_base, tmp_path, monkeypatch):
    """TRL's ``SFTTrainer`` (its fused LM head, gradient checkpointing, bf16) with the
    callback trains; chunked-ce leaves TRL's fused head (which stores no logits either) as
    it is instead of hiding the labels its forward reads."""
    monkeypatch.setenv("SLIMACT_CACHE", str(tmp_path / "cache"))
    cb = hf.SlimactCallback(_spec(strategy, tmp_path))
    _follows(_losses(_sft(_llama(), tmp_path, [cb])), sft_base, strategy)
    assert cb.saved_bytes is not None


@pytest.fixture(scope="module")
def sft_base_twenty(tmp_path_factory):
    return _losses(_sft(_llama(), tmp_path_factory.mktemp("sft20"), steps=20))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [*EXACT, *APPROX])
def test_sft_trainer_twenty_steps(strategy, sft_base_twenty, tmp_path, monkeypatch):
    """Twenty SFT steps per strategy follow the run without slimact (lossy: 2e-2 relative)."""
    monkeypatch.setenv("SLIMACT_CACHE", str(tmp_path / "cache"))
    base = sft_base_twenty
    cb = hf.SlimactCallback(_spec(strategy, tmp_path))
    losses = _losses(_sft(_llama(), tmp_path, [cb], steps=20))
    assert len(losses) == 20 and all(map(torch.isfinite, torch.tensor(losses)))
    rel = torch.tensor(losses).sub(torch.tensor(base)).abs().div(torch.tensor(base))
    assert rel.max() <= (1e-5 if strategy in EXACT else 2e-2), (losses, base)
    # (the 1e-5 of the exact strategies holds over 20 steps: their gradients are exact)


# ----------------------------------------------------------------------------- accelerate
def test_accelerate_loop(tmp_path):
    """A plain accelerate loop (bf16, gradient accumulation 2) on a model slimact changed
    before ``prepare``: the losses are the unchanged model's."""
    accelerate = pytest.importorskip("accelerate")

    def train(strategy: str | None) -> list[float]:
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
        acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)  # fmt: skip
        model = _llama()
        if strategy is not None:
            slimact.apply(model, strategy)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        data = torch.utils.data.DataLoader(_Rows(_rows()), batch_size=2, collate_fn=_collate)
        model, opt, data = acc.prepare(model, opt, data)
        losses = []
        for batch in data:
            with acc.accumulate(model):
                loss = model(**batch).loss
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            losses.append(float(loss.detach()))
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
        return losses

    base = train(None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _follows(train("chunked-ce"), base, "chunked-ce")


# ----------------------------------------------------------------------------- README
README = Path(__file__).resolve().parents[1] / "README.md"
# the snippets' downloads, replaced by tiny local stand-ins, and their training arguments with
# use_cpu=True (bf16 is refused on a machine without a GPU otherwise) and two steps added; the
# rest runs verbatim
TWO_STEPS = "use_cpu=True, max_steps=2, per_device_train_batch_size=2, "
STAND_INS = {
    'tokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen2.5-0.5B")': "tokenizer = _tokenizer()",
    'model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-0.5B")': "model = _qwen2()",
    'dataset = load_dataset("stanfordnlp/imdb", split="train")': "dataset = _texts()",
    'TrainingArguments("out", ': f'TrainingArguments("out", {TWO_STEPS}',
    'SFTConfig("out", ': f'SFTConfig("out", {TWO_STEPS}',
}


def _qwen2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(cfg)


def _texts():
    datasets = pytest.importorskip("datasets")
    rows = [" ".join(f"t{i}" for i in r) for r in _rows()]
    return datasets.Dataset.from_dict({"text": rows, "label": [0] * len(rows)})


def _finetuning_snippets() -> str:
    section = README.read_text().split("### Fine-tuning with peft/TRL\n", 1)[1]
    blocks = re.findall(r"```python\n(.+?)```", section.split("\n### ", 1)[0], flags=re.S)
    assert len(blocks) == 2, blocks  # peft + Trainer; SFTTrainer with the callback
    code = "\n".join(blocks)
    for line, stand_in in STAND_INS.items():
        assert code.count(line) == 1, f"README snippet changed: {line!r} not found once"
        code = code.replace(line, stand_in)
    return code


def test_readme_finetuning_snippets_run(tmp_path, monkeypatch):
    """The README's fine-tuning snippets run as written, with a tiny Qwen2, its tokenizer and
    a few texts in place of the downloads: LoRA + slimact + Trainer, then SFTTrainer with the
    callback, which measured the first step."""
    pytest.importorskip("peft")
    pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLIMACT_CACHE", str(tmp_path / "cache"))
    ns = {"_tokenizer": _tokenizer, "_qwen2": _qwen2, "_texts": _texts}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(_finetuning_snippets(), str(README), "exec"), ns)
    assert ns["cb"].saved_bytes > 0
    assert (tmp_path / "out" / "adapter_config.json").is_file()
    assert not slimact.applied(ns["model"])  # the callback reverted at train end
