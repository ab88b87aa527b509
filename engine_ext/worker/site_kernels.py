"""The CUDA site kernels of `intervention_op` (Triton; imported only where they run): `site_edit`,
one site on one row's values, and the two kernels built from it — `site_kernel` (one site per
launch) and `sites_kernel` (`intervention_op.sites_op`: `mlp_out`, `post_block` and the next
layer's `pre_attn` in one launch, each site's result held in registers in the stream's dtype, as
storing and reloading it would give). The arithmetic is `intervention_op`'s (its docstring);
`tests/test_site_kernels_interpreted.py` runs both kernels under Triton's CPU interpreter against
the torch implementation."""

import triton
import triton.language as tl


@triton.jit
def site_edit(x, r, row, slot, cap, offs, m, mode_ptr, a_ptr, adim_ptr, dima_ptr, c_ptr, px_ptr, pr_ptr,
              capx_ptr, capr_ptr, sclamp_ptr, cdir_ptr, clo_ptr, chi_ptr, cst_ptr,
              sgate_ptr, gprobe_ptr, gparams_ptr, gterm_ptr, gout_ptr, hidden,
              HAS_R: tl.constexpr, PAIR: tl.constexpr, KC: tl.constexpr):
    """One site on one row's values (x, r; r all zero without HAS_R): the slot's edit, then the
    capture of the result. Returns the new (x, r)."""
    x_new = x
    r_new = r
    if slot >= 0:
        mode = tl.load(mode_ptr + slot)
        if mode == PAIR:
            x_new = tl.load(px_ptr + slot * hidden + offs, mask=m)
            if HAS_R:
                r_new = tl.load(pr_ptr + slot * hidden + offs, mask=m)
        else:
            a = tl.load(a_ptr + slot)
            adim = tl.load(adim_ptr + slot)
            a_row = tl.load(dima_ptr + tl.maximum(adim, 0) * hidden + offs, mask=m & (adim >= 0), other=0.0)
            a = tl.where(adim >= 0, a_row, a)
            c = tl.load(c_ptr + slot * hidden + offs, mask=m)
            if HAS_R:
                s = x.to(tl.float32) + r.to(tl.float32)
            else:
                s = x.to(tl.float32)
            new = tl.where(a == 0.0, c, a * s + c)
            gq = tl.load(sgate_ptr + slot)
            if gq >= 0:  # row gate: g from the pre-edit value, scaling the gated term
                pr = tl.load(gprobe_ptr + gq * hidden + offs, mask=m, other=0.0)
                score = tl.sum(tl.where(m, s, 0.0) * pr, axis=0)
                thr = tl.load(gparams_ptr + gq * 2)
                sharp = tl.load(gparams_ptr + gq * 2 + 1)
                g = 1.0 / (1.0 + tl.exp(-(sharp * (score - thr))))
                term = tl.load(gterm_ptr + gq * hidden + offs, mask=m, other=0.0)
                new = new + (g - 1.0) * term
                tl.store(gout_ptr + row * 2, score)
                tl.store(gout_ptr + row * 2 + 1, g)
            cl = tl.load(sclamp_ptr + slot)
            if cl >= 0:  # directional clamps: every projection from the same `new`, then one correction
                live = tl.where(m, new, 0.0)
                corr = tl.zeros_like(live)
                for k in tl.static_range(KC):
                    d = tl.load(cdir_ptr + (cl * KC + k) * hidden + offs, mask=m, other=0.0)
                    p = tl.sum(live * d, axis=0)
                    lo = tl.load(clo_ptr + cl * KC + k)
                    hi = tl.load(chi_ptr + cl * KC + k)
                    st = tl.load(cst_ptr + cl * KC + k)
                    corr += (st * (tl.minimum(tl.maximum(p, lo), hi) - p)) * d
                new = new + corr
            if HAS_R:
                r_new = new.to(r.dtype)
                x_new = (new - r_new.to(tl.float32)).to(x.dtype)
            else:
                x_new = new.to(x.dtype)
    if cap >= 0:
        tl.store(capx_ptr + cap * hidden + offs, x_new, mask=m)
        tl.store(capr_ptr + cap * hidden + offs, r_new, mask=m)
    return x_new, r_new

@triton.jit
def site_kernel(x_ptr, r_ptr, row_slot_ptr, cap_dst_ptr, mode_ptr, a_ptr, adim_ptr, dima_ptr, c_ptr, px_ptr, pr_ptr,
                capx_ptr, capr_ptr, sclamp_ptr, cdir_ptr, clo_ptr, chi_ptr, cst_ptr,
                sgate_ptr, gprobe_ptr, gparams_ptr, gterm_ptr, gout_ptr,
                site, num_sites, hidden, stride_x, stride_r,
                HAS_R: tl.constexpr, BLOCK: tl.constexpr, PAIR: tl.constexpr, KC: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(row_slot_ptr + row * num_sites + site)
    cap = tl.load(cap_dst_ptr + row * num_sites + site)
    if (slot < 0) & (cap < 0):
        return
    offs = tl.arange(0, BLOCK)
    m = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=m)
    if HAS_R:
        r = tl.load(r_ptr + row * stride_r + offs, mask=m)
    else:
        r = tl.zeros_like(x)
    x_new, r_new = site_edit(x, r, row, slot, cap, offs, m, mode_ptr, a_ptr, adim_ptr, dima_ptr, c_ptr, px_ptr, pr_ptr,
                             capx_ptr, capr_ptr, sclamp_ptr, cdir_ptr, clo_ptr, chi_ptr, cst_ptr,
                             sgate_ptr, gprobe_ptr, gparams_ptr, gterm_ptr, gout_ptr, hidden,
                             HAS_R=HAS_R, PAIR=PAIR, KC=KC)
    if slot >= 0:
        tl.store(x_ptr + row * stride_x + offs, x_new, mask=m)
        if HAS_R:
            tl.store(r_ptr + row * stride_r + offs, r_new, mask=m)

@triton.jit
def sites_kernel(x_ptr, r_ptr, row_slot_ptr, cap_dst_ptr, mode_ptr, a_ptr, adim_ptr, dima_ptr, c_ptr, px_ptr, pr_ptr,
                 capx_ptr, capr_ptr, sclamp_ptr, cdir_ptr, clo_ptr, chi_ptr, cst_ptr,
                 sgate_ptr, gprobe_ptr, gparams_ptr, gterm_ptr, gout_ptr,
                 site_b, site_p, site_n, num_sites, hidden, stride_x, stride_r,
                 HAS_N: tl.constexpr, BLOCK: tl.constexpr, PAIR: tl.constexpr, KC: tl.constexpr):
    """`sites_op`: the branch site `site_b` on x alone, the pair site `site_p` on (x, r), then
    (HAS_N) the pair site `site_n` on the result."""
    row = tl.program_id(0)
    base = row * num_sites
    slot_b = tl.load(row_slot_ptr + base + site_b)
    cap_b = tl.load(cap_dst_ptr + base + site_b)
    slot_p = tl.load(row_slot_ptr + base + site_p)
    cap_p = tl.load(cap_dst_ptr + base + site_p)
    idle = (slot_b < 0) & (cap_b < 0) & (slot_p < 0) & (cap_p < 0)
    slot_n = -1
    cap_n = -1
    if HAS_N:
        slot_n = tl.load(row_slot_ptr + base + site_n)
        cap_n = tl.load(cap_dst_ptr + base + site_n)
        idle = idle & (slot_n < 0) & (cap_n < 0)
    if idle:
        return
    offs = tl.arange(0, BLOCK)
    m = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=m)
    r = tl.load(r_ptr + row * stride_r + offs, mask=m)
    # the branch site: the value is x alone (its capture stores r = 0)
    xb, _ = site_edit(x, tl.zeros_like(r), row, slot_b, cap_b, offs, m, mode_ptr, a_ptr, adim_ptr, dima_ptr, c_ptr,
                      px_ptr, pr_ptr, capx_ptr, capr_ptr, sclamp_ptr, cdir_ptr, clo_ptr, chi_ptr, cst_ptr,
                      sgate_ptr, gprobe_ptr, gparams_ptr, gterm_ptr, gout_ptr, hidden,
                      HAS_R=False, PAIR=PAIR, KC=KC)
    xp, rp = site_edit(xb, r, row, slot_p, cap_p, offs, m, mode_ptr, a_ptr, adim_ptr, dima_ptr, c_ptr,
                       px_ptr, pr_ptr, capx_ptr, capr_ptr, sclamp_ptr, cdir_ptr, clo_ptr, chi_ptr, cst_ptr,
                       sgate_ptr, gprobe_ptr, gparams_ptr, gterm_ptr, gout_ptr, hidden,
                       HAS_R=True, PAIR=PAIR, KC=KC)
    if HAS_N:
        xp, rp = site_edit(xp, rp, row, slot_n, cap_n, offs, m, mode_ptr, a_ptr, adim_ptr, dima_ptr, c_ptr,
                           px_ptr, pr_ptr, capx_ptr, capr_ptr, sclamp_ptr, cdir_ptr, clo_ptr, chi_ptr, cst_ptr,
                           sgate_ptr, gprobe_ptr, gparams_ptr, gterm_ptr, gout_ptr, hidden,
                           HAS_R=True, PAIR=PAIR, KC=KC)
    if (slot_b >= 0) | (slot_p >= 0) | (slot_n >= 0):
        tl.store(x_ptr + row * stride_x + offs, xp, mask=m)
        tl.store(r_ptr + row * stride_r + offs, rp, mask=m)
