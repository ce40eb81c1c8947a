"""PLE table (`ple.table`): sharded loading, lookup parity with transformers, host/GPU storage, errors."""

import os

import pytest
import torch
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

from helpers.configs import EOS, tiny_text_config
from qwen4_exp_hcu.ple.hashing import NgramHashSpec, ngram_ids
from qwen4_exp_hcu.ple.formats.int8 import dequantize_rows, quantize_rows
from qwen4_exp_hcu.ple.storage import PLEStorage
from qwen4_exp_hcu.ple.table import PLETable


def shards(weight, parts):
    n = -(-weight.shape[0] // parts)
    return n, [weight[j * n : (j + 1) * n] for j in range(parts)]


def table_from(weight, parts=4, quantized=False, **kw):
    n, pieces = shards(weight, parts)
    t = PLETable(weight.shape[0], weight.shape[1], PLEStorage("int8" if quantized else "bf16", **kw), shard_rows=n)
    for j in t.expected_shards():
        t.load_shard(j, pieces[j])
    t.check_loaded()
    return t


def test_bf16_lookup_equals_transformers_embedding():
    cfg = tiny_text_config(ngram_size=3, heads_per_ngram=4)
    emb = Qwen4ExpTextNGramEmbedding(cfg, cfg.ple_embed_dim, 2, 1).to(torch.bfloat16)
    torch.nn.init.normal_(emb.ngram_embedding.weight)
    spec = NgramHashSpec.from_config(cfg, 1)
    prompts = [[1, 2, 3, EOS, 4, 5], [9, 9, 9, 9], [EOS, 3]]
    ids = torch.tensor([t for p in prompts for t in p])
    qsl = torch.tensor([0, 6, 10, 12], dtype=torch.int32)
    rows = ngram_ids(spec, ids, qsl, torch.full((3, 2), EOS))
    table = table_from(emb.ngram_embedding.weight.detach(), parts=cfg.split_ngram_parts)
    got = table.lookup(rows)
    want = torch.cat([emb(torch.tensor([p]), None)[0] for p in prompts])
    assert torch.equal(got, want)


def test_int8_table_and_etp_ranges_sum_to_whole():
    w = torch.randn(203, 16, dtype=torch.bfloat16)
    q, s = quantize_rows(w)
    want = dequantize_rows(q, s)
    ids = torch.randint(0, 203, (50, 3))
    n, qs = shards(q, 5)
    _, ss = shards(s, 5)
    total = torch.zeros(50, 48, dtype=torch.float32)
    for start, end in [(0, 70), (70, 71), (71, 71), (71, 203)]:
        t = PLETable(203, 16, PLEStorage("int8"), start=start, end=end, shard_rows=n)
        for j in t.expected_shards():
            t.load_shard(j, qs[j], ss[j])
        t.check_loaded()
        total += t.lookup(ids).float()
    assert torch.equal(total.to(torch.bfloat16), want[ids].flatten(1))


def test_bf16_checkpoint_into_int8_storage_quantizes_on_load():
    w = torch.randn(40, 8, dtype=torch.bfloat16)
    t = table_from(w, quantized=True)
    q, s = quantize_rows(w)
    assert torch.equal(t.weight, q) and torch.equal(t.scale, s)


def expected_pages(*nbytes: int) -> str:
    """What `use_thp` must get here for host tensors of `nbytes` each, read from the kernel's own settings
    before they are allocated: hugetlb pages when enough are free for all, else THP unless it is off, else
    4 KiB pages."""
    meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines())
    free_hugetlb = int(meminfo.get("HugePages_Free", "0").split()[0])
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    thp_on = os.path.exists(thp) and "[never]" not in open(thp).read()
    return "hugetlb" if free_hugetlb >= sum(-(-n // (2 << 20)) for n in nbytes) else "thp" if thp_on else "4k"


def test_huge_page_table_is_exact_and_on_the_pages_the_kernel_offers(caplog):
    """use_thp: the rows look up exactly, and sit on the pages this machine's settings give (hugetlb,
    THP, or 4 KiB with a warning); the kernel really maps them on 2 MiB pages unless they are 4 KiB."""
    from qwen4_exp_hcu.ple.tiers import host_memory

    w = torch.randn(40_000, 64, dtype=torch.bfloat16)  # INT8 rows: 2.4 MiB
    want = expected_pages(w.numel(), 40_000 * 2)  # INT8 rows, bf16 scales
    with caplog.at_level("WARNING", logger=host_memory.__name__):
        t = table_from(w, parts=3, quantized=True, host=True, huge_pages=True)
    ids = torch.randint(-5, 40_005, (500, 4))
    assert torch.equal(t.lookup(ids), table_from(w, parts=3, quantized=True).lookup(ids))
    assert t.pages == want, (t.pages, want)
    assert ("2 MiB pages" in t.describe()) == (want != "4k") and ("use_thp" in caplog.text) == (want == "4k")
    if want == "thp":  # the kernel really backs the rows with huge pages
        assert smaps_kib(t.weight, "AnonHugePages") >= 2048
    elif want == "hugetlb":
        assert smaps_kib(t.weight, "KernelPageSize") == 2048


def test_huge_pages_fall_back_to_4k_with_a_warning(monkeypatch, tmp_path, caplog):
    from qwen4_exp_hcu.ple.tiers import host_memory

    off = tmp_path / "enabled"
    off.write_text("always madvise [never]\n")
    monkeypatch.setattr(host_memory, "THP_SETTING", off)
    monkeypatch.setattr(host_memory, "_free_hugetlb_bytes", lambda: 0)
    w = torch.randn(100, 64, dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger=host_memory.__name__):
        t = table_from(w, quantized=True, host=True, huge_pages=True)
    assert t.pages == "4k" and "use_thp" in caplog.text
    assert torch.equal(t.lookup(torch.arange(100)[:, None]), table_from(w, quantized=True).lookup(torch.arange(100)[:, None]))


def smaps_kib(tensor, field: str) -> int:
    """`field` (kB) of the mapping holding `tensor` (/proc/self/smaps)."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        fields = line.split()
        if fields and "-" in fields[0] and all(c in "0123456789abcdef-" for c in fields[0]):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= tensor.data_ptr() < hi:
                for entry in lines[i + 1 : i + 30]:
                    if entry.startswith(f"{field}:"):
                        return int(entry.split()[1])
    return 0


def test_bad_inputs_named():
    with pytest.raises(ValueError, match=r"\[5, 20\) is not inside the table's 10 rows"):
        PLETable(10, 4, start=5, end=20)
    t = PLETable(10, 4, PLEStorage("int8"), shard_rows=5)
    q, s = quantize_rows(torch.randn(5, 4))
    with pytest.raises(ValueError, match="shard_0_scale"):
        t.load_shard(0, q, s.float(), name="shard_0")
    with pytest.raises(ValueError, match="shard_0_scale"):
        t.load_shard(0, q, s[:4], name="shard_0")
    with pytest.raises(ValueError, match="shard_0_scale"):
        t.load_shard(0, q, torch.full_like(s, float("nan")), name="shard_0")
    with pytest.raises(ValueError, match="shard_0_scale"):
        t.load_shard(0, q, -s.abs() - 1, name="shard_0")
    t.load_shard(0, torch.zeros_like(q), torch.zeros_like(s), name="shard_0")  # all-zero rows: scale 0 is fine
    with pytest.raises(ValueError, match=r"shards \[1\] were never loaded"):
        t.check_loaded()
    with pytest.raises(ValueError, match="shard_1"):
        t.load_shard(1, q[:, :3], s, name="shard_1")
    ids = torch.zeros(3, 2, dtype=torch.int64)
    wrong_device = torch.empty(3, 8, dtype=torch.bfloat16, device="meta")
    for bad in (torch.empty(3, 8), torch.empty(3, 7, dtype=torch.bfloat16), torch.empty(2, 8, dtype=torch.bfloat16), wrong_device):
        with pytest.raises(ValueError, match="lookup out must be"):
            t.lookup(ids, out=bad)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "host, options",
    [(False, {}), (True, {}), (True, {"huge_pages": True}), (True, {"scales_on_device": True})],
    ids=["device", "pinned_host", "host_2mib_pages", "host_rows_device_scales"],
)
@pytest.mark.parametrize("quantized", [False, True])
def test_gpu_lookup_exact_device_and_pinned_host(host, options, quantized):
    w = torch.randn(1000, 64, dtype=torch.bfloat16)
    t = table_from(w, parts=7, quantized=quantized, device="cuda", host=host, **options)
    assert t.weight.is_pinned() == host and (t.weight.device.type == "cpu") == host
    if quantized and options.get("scales_on_device"):
        assert t.scale.is_cuda
    ids = torch.randint(-5, 1005, (300, 8), device="cuda")
    got = t.lookup(ids)
    cpu = table_from(w, parts=7, quantized=quantized)
    assert torch.equal(got.cpu(), cpu.lookup(ids.cpu()))


@pytest.mark.gpu
def test_gpu_cuda_graph_hash_and_lookup_replay():
    cfg = tiny_text_config(ngram_size=3, heads_per_ngram=4)
    spec = NgramHashSpec.from_config(cfg, 0)
    w = torch.randn(spec.rows, spec.head_dim, dtype=torch.bfloat16)
    t = table_from(w, parts=4, quantized=True, device="cuda", host=True)
    cpu = table_from(w, parts=4, quantized=True)
    T, B = 64, 4
    ids = torch.zeros(T, dtype=torch.int64, device="cuda")
    qsl = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    ctx = torch.full((B, 2), EOS, dtype=torch.int64, device="cuda")
    rows = torch.empty(T, spec.num_heads, dtype=torch.int64, device="cuda")
    out = torch.empty(T, spec.num_heads * spec.head_dim, dtype=torch.bfloat16, device="cuda")

    def step():
        ngram_ids(spec, ids, qsl, ctx, out=rows)
        t.lookup(rows, out=out)

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        step()  # compile kernels outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids.copy_(torch.randint(0, 97, (T,), generator=g))
        cuts = torch.sort(torch.randint(0, T + 1, (B - 1,), generator=g)).values
        qsl.copy_(torch.cat([torch.tensor([0]), cuts, torch.tensor([T])]))
        ctx.copy_(torch.randint(0, 97, (B, 2), generator=g))
        graph.replay()
        torch.cuda.synchronize()
        want = cpu.lookup(ngram_ids(spec, ids.cpu(), qsl.cpu(), ctx.cpu()))
        assert torch.equal(out.cpu(), want)


@pytest.mark.gpu
def test_gpu_hot_row_cache_changes_nothing_but_speed():
    w = torch.randn(5000, 128, dtype=torch.bfloat16)
    t = table_from(w, parts=3, quantized=True, device="cuda", host=True)
    ids = torch.randint(0, 5000, (512, 16), device="cuda")
    plain = t.lookup(ids).clone()
    hot = t.enable_hot_rows(1000)
    assert 0 < hot.fill(ids[:256]) <= 1 and hot.rows.shape == (1000, 128)
    assert torch.equal(t.lookup(ids), plain)
    traffic = t.enable_hot_rows(1000, observe=True)  # refreshed from the lookups themselves
    traffic.refresh_every = 2
    for _ in range(4):
        assert torch.equal(t.lookup(ids), plain)
    assert traffic.refreshes == 2 and int((traffic.slot_row >= 0).sum()) == 1000


@pytest.mark.gpu
def test_gpu_host_table_is_exactly_its_size_and_released():
    for _ in range(3):  # re-registering freed memory would fail if a table were not unregistered
        t = PLETable(1_000_003, 128, PLEStorage("int8", "cuda", host=True))
        assert t.weight.is_pinned() and t.scale.is_pinned()
        assert t.weight.untyped_storage().nbytes() == 1_000_003 * 128
        assert t.nbytes == 1_000_003 * 130
        del t
