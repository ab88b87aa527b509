"""Does this host's CPU GEMM give a row the same bits whatever the number of rows beside it?
causalboard's CPU tests compare cells run in one batch with the same cells run alone bit for
bit; that holds only where the fp32 GEMM vLLM's CPU layers call (oneDNN's `onednn_mm`, else
torch's `linear`) is row-invariant. Prints, for several row counts M, whether the first M rows
of a 64-row product equal the product of those M rows alone; then whether oneDNN called on fixed
16-row chunks (the tail padded with zeros) is row-invariant (a candidate for exact CPU engines).

    .venv/bin/python benchmarks/diag/gemm_row_invariance.py
"""
import json

import torch


def main() -> None:
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    w = torch.randn(256, 128)
    x = torch.randn(64, 128)
    handler = ops.create_onednn_mm(w.t(), 32)
    full_dnn, full_torch = ops.onednn_mm(handler, x, None), torch.nn.functional.linear(x, w)
    for m in (1, 2, 5, 7, 16, 33):
        part = ops.onednn_mm(handler, x[:m].contiguous(), None)
        print(json.dumps({"bench": "gemm_row_invariance", "m": m,
                          "onednn_equal": bool(torch.equal(part, full_dnn[:m])),
                          "onednn_max_diff": float((part - full_dnn[:m]).abs().max()),
                          "torch_equal": bool(torch.equal(torch.nn.functional.linear(x[:m], w), full_torch[:m]))}))

    def chunked(rows: torch.Tensor, c: int = 16) -> torch.Tensor:  # every call exactly c rows (the tail padded)
        pad = (-rows.shape[0]) % c
        xp = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) if pad else rows
        return torch.cat([ops.onednn_mm(handler, xp[i: i + c].contiguous(), None) for i in range(0, xp.shape[0], c)])[: rows.shape[0]]

    ref = chunked(x)
    print(json.dumps({"bench": "gemm_row_invariance", "variant": "onednn_16_row_chunks",
                      "row_invariant_m_1_to_64": all(torch.equal(chunked(x[:m]), ref[:m]) for m in range(1, 65)),
                      "position_in_chunk_irrelevant": bool(torch.equal(chunked(torch.roll(x, 3, 0)), torch.roll(ref, 3, 0)))}))


if __name__ == "__main__":
    main()
