"""The hf variant's worker: HF transformers with forward hooks, batch sizes swept."""

from __future__ import annotations

import os
import shutil
import time

from host import GpuMemPoller
from outputs import check_space, dir_bytes, record_error, reset_dir
from records import OK, SKIPPED
from workloads import make_workload, model_config, prompt_ids


def run_hf(spec: dict, emit, poller: GpuMemPoller) -> None:
    """transformers forward with hooks on the chosen layers; saves upstream's file format.

    Builds the language model alone (Qwen3_5ForCausalLM from text_config, random weights, on
    the GPU), as vllm_gdn_hs.verify.checkpoint does: transformers 5.17 cannot build this config's
    vision tower, and vLLM's language_model_only skips it too.

    The hooks repeat vllm_gdn_hs.verify.reference.hf_hidden_states' (layer id k: the output of
    decoder layer k - 1, 0: the embeddings), which does not fit here: it runs one prompt per
    forward pass and computes the logits of every position, where this measures right-padded
    batches with the logits of the last position only (logits_to_keep=1), as vLLM's prefill.
    """
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        import fla  # noqa: F401  (transformers picks up fla's GDN kernels when importable)

        fla_ok = True
    except Exception:
        fla_ok = False
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    text = dict(model_config(spec["shape"])["text_config"])
    cfg = AutoConfig.for_model(text.pop("model_type"), **text)
    torch.manual_seed(0)
    with torch.device(dev):  # weights made and initialised on the GPU, no CPU copy
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    if dev == "cuda":
        torch.cuda.synchronize()
    startup = dict(
        startup_s=round(time.perf_counter() - t0, 1),
        startup_peak_gpu_mib=poller.take(),
        fla_available=fla_ok,
        device=dev,
        hf_model=type(model).__name__,
        attn_implementation=getattr(model.config, "_attn_implementation", None),
    )

    captured: dict[int, torch.Tensor] = {}

    def hook(k):
        def fn(module, inputs, output):
            captured[k] = output[0] if isinstance(output, tuple) else output

        return fn

    body = model.model  # the decoder stack under the LM head
    for k in spec["layers"]:  # id 0 is the embeddings, id k the output of decoder layer k-1
        (body.embed_tokens if k == 0 else body.layers[k - 1]).register_forward_hook(hook(k))

    pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="hf-hs-save")
    out_dir = spec["out_dir"]

    def run_batch(ids: list[list[int]], names: list[str] | None) -> list:
        # Right padding needs no attention mask: causal attention and the GDN recurrence never
        # let a real token see the padding after it.
        x = torch.zeros(len(ids), max(map(len, ids)), dtype=torch.long)
        for j, seq in enumerate(ids):
            x[j, : len(seq)] = torch.tensor(seq)
        with torch.inference_mode():  # logits of the last position only, as vLLM's prefill
            model(input_ids=x.to(dev), use_cache=False, logits_to_keep=1)
            hs = torch.stack([captured[k] for k in spec["layers"]], dim=2).cpu()  # B,T,layers,H
        captured.clear()
        if names is None:
            return []
        return [
            pool.submit(
                save_file,
                {"hidden_states": hs[j, : len(seq)], "token_ids": torch.tensor(seq)},
                os.path.join(out_dir, n),
            )
            for j, (seq, n) in enumerate(zip(ids, names, strict=True))
        ]

    for name in spec["workloads"]:
        w = make_workload(name, spec["seed"])
        all_ids = prompt_ids(w, spec["seed"])
        order = sorted(range(len(all_ids)), key=lambda i: -len(all_ids[i]))  # least padding
        for bs in spec["hf_batch_sizes"]:
            rec = dict(w.stats(), **startup, batch_size=bs)
            if w.output_tokens:
                rec.update(
                    status=SKIPPED, error="skipped: the hf variant measures prefill-only workloads"
                )
                emit(rec)
                break
            try:
                batches = [order[i : i + bs] for i in range(0, len(order), bs)]
                reset_dir(out_dir)
                check_space(out_dir, w, spec)
                for n in (1024, 1023):  # warm-up; Triton specialises lengths on n % 16 == 0
                    run_batch([all_ids[i][:n] for i in batches[0]], None)
                if dev == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                poller.take()
                t0 = time.perf_counter()
                futures = []
                for b in batches:
                    names = [f"req-{i}.safetensors" for i in b]
                    futures += run_batch([all_ids[i] for i in b], names)
                gen_s = time.perf_counter() - t0
                for f in futures:
                    f.result()
                ready_s = time.perf_counter() - t0 - gen_s  # the wait for the save threads
                nbytes, nfiles = dir_bytes(out_dir)
                rec.update(
                    status=OK,
                    gen_s=round(gen_s, 3),
                    files_ready_s=round(ready_s, 3),
                    output_tokens=0,
                    padded_tokens=sum(len(b) * len(all_ids[b[0]]) for b in batches),
                    files=nfiles,
                    bytes_written=nbytes,
                    peak_gpu_mib=poller.take(),
                    torch_peak_mib=torch.cuda.max_memory_allocated() // 2**20
                    if dev == "cuda"
                    else None,
                )
            except Exception as e:
                record_error(rec, e)
            captured.clear()
            if dev == "cuda":
                torch.cuda.empty_cache()
            emit(rec)
            reset_dir(out_dir)
    pool.shutdown()
    shutil.rmtree(out_dir, ignore_errors=True)
