"""Plain-Python loop versions of the algorithms (float math, no torch ops), written independently of
rlkit.algos so the vectorised code has something to be wrong against."""

from __future__ import annotations

import math
import statistics


def tolist(t):
    return t.tolist() if hasattr(t, "tolist") else t


def groups(index):
    out: dict[int, list[int]] = {}
    for i, g in enumerate(tolist(index)):
        out.setdefault(g, []).append(i)
    return out


def scores_of(rewards):
    return [sum(row) for row in tolist(rewards)]


def broadcast(values, mask):
    return [[v * m for m in row] for v, row in zip(values, tolist(mask))]


def grpo(rewards, mask, index, norm=True, eps=1e-6):
    s = scores_of(rewards)
    adv = [0.0] * len(s)
    for members in groups(index).values():
        vals = [s[i] for i in members]
        mean, std = (0.0, 1.0) if len(vals) == 1 else (statistics.fmean(vals), statistics.stdev(vals))
        for i in members:
            adv[i] = (s[i] - mean) / (std + eps) if norm else s[i] - mean
    return broadcast(adv, mask)


def rloo(rewards, mask, index):
    s = scores_of(rewards)
    adv = list(s)
    for members in groups(index).values():
        n = len(members)
        if n > 1:
            for i in members:
                others = [s[j] for j in members if j != i]
                adv[i] = s[i] - sum(others) / (n - 1)  # leave-one-out mean, written directly
    return broadcast(adv, mask)


def opo(rewards, mask, index):
    s = scores_of(rewards)
    lengths = [sum(row) for row in tolist(mask)]
    adv = list(s)
    for members in groups(index).values():
        if len(members) > 1:
            b = sum(lengths[i] * s[i] for i in members) / sum(lengths[i] for i in members)
            for i in members:
                adv[i] = s[i] - b
    return broadcast(adv, mask)


def gpg(rewards, mask, index):
    s = scores_of(rewards)
    alpha = len(s) / max(1, sum(1 for v in s if v != 0))
    adv = [0.0] * len(s)
    for members in groups(index).values():
        mean = 0.0 if len(members) == 1 else statistics.fmean(s[i] for i in members)
        for i in members:
            adv[i] = alpha * (s[i] - mean)
    return broadcast(adv, mask)


def passk(rewards, mask, index, norm=True, eps=1e-6):
    s = scores_of(rewards)
    adv = [0.0] * len(s)
    for members in groups(index).values():
        ordered = sorted(members, key=lambda i: -s[i])  # stable: first best wins ties
        gap = s[ordered[0]] - s[ordered[1]]
        if norm:
            gap /= statistics.stdev([s[i] for i in members]) + eps
        adv[ordered[0]] = gap
    return broadcast(adv, mask)


def whiten(values, mask):
    flat = [v for row, mrow in zip(values, tolist(mask)) for v, m in zip(row, mrow) if m]
    mean = statistics.fmean(flat)
    var = sum((v - mean) ** 2 for v in flat) / (len(flat) - 1)
    return [[(v - mean) / math.sqrt(var + 1e-8) for v in row] for row in values]


def rfpp_baseline(rewards, mask, index):
    s = scores_of(rewards)
    centred = list(s)
    for members in groups(index).values():
        mean = 0.0 if len(members) == 1 else statistics.fmean(s[i] for i in members)
        for i in members:
            centred[i] = s[i] - mean
    w = whiten(broadcast(centred, mask), mask)
    return [[v * m for v, m in zip(row, mrow)] for row, mrow in zip(w, tolist(mask))]


def rfpp(rewards, mask, gamma):
    r, m = tolist(rewards), tolist(mask)
    returns = []
    for row, mrow in zip(r, m):
        # a valid response is a prefix of ones; the return-to-go restarts at its end
        out = [0.0] * len(row)
        running = 0.0
        for t in reversed(range(len(row))):
            running = row[t] + gamma * running
            out[t] = running
            running *= mrow[t]
        returns.append(out)
    w = whiten(returns, m)
    return [[v * k for v, k in zip(row, mrow)] for row, mrow in zip(w, m)], returns


def gae(rewards, values, mask, gamma, lam):
    r, v, m = tolist(rewards), tolist(values), tolist(mask)
    adv = []
    for row_r, row_v, row_m in zip(r, v, m):
        valid = [t for t in range(len(row_r)) if row_m[t]]
        out = [0.0] * len(row_r)
        running, next_v = 0.0, 0.0
        for t in reversed(valid):  # masked positions are skipped entirely
            delta = row_r[t] + gamma * next_v - row_v[t]
            running = delta + gamma * lam * running
            next_v = row_v[t]
            out[t] = running
        # positions after the last valid token keep 0 only if no valid token follows; earlier masked
        # ones carry the running advantage of the next valid token (veRL carries it through)
        carry = 0.0
        for t in reversed(range(len(row_r))):
            if row_m[t]:
                carry = out[t]
            else:
                out[t] = carry
        adv.append(out)
    returns = [[a + b for a, b in zip(ra, rv)] for ra, rv in zip(adv, v)]
    return whiten(adv, m), returns


def agg(loss, mask, mode, max_len=None):
    loss, mask = tolist(loss), tolist(mask)
    rows = [(sum(x * k for x, k in zip(lr, mr)), sum(mr)) for lr, mr in zip(loss, mask)]
    seqs = sum(1 for _, n in rows if n > 0)
    if mode == "token-mean":
        return sum(s for s, _ in rows) / sum(n for _, n in rows)
    if mode == "seq-mean-token-sum":
        return sum(s for s, n in rows if n > 0) / seqs
    if mode == "seq-mean-token-mean":
        return sum(s / n for s, n in rows if n > 0) / seqs
    if mode == "seq-mean-token-sum-norm":
        return sum(s for s, _ in rows) / seqs / (max_len or len(loss[0]))
    raise ValueError(mode)


def ppo_clip_token(logp, old, a, low, high, c):
    ratio = math.exp(max(-20.0, min(20.0, logp - old)))
    l1 = -a * ratio
    l2 = -a * min(max(ratio, 1 - low), 1 + high)
    clipped = max(l1, l2)
    return min(clipped, -a * c) if a < 0 else clipped


# ---------------------------------------------------------------- entropy-aware and sequence-level losses
def _clamp(x, lo, hi):
    return max(lo, min(hi, x))


def _means(values, mask):
    flat = [v for row, mrow in zip(values, mask) for v, m in zip(row, mrow) if m]
    return sum(flat) / len(flat)


def covariances(logp, adv, mask):
    """(A - mean A)(logp - mean logp) per token, means over valid tokens."""
    logp, adv, mask = tolist(logp), tolist(adv), tolist(mask)
    ma, ml = _means(adv, mask), _means(logp, mask)
    return [[(a - ma) * (lp - ml) for a, lp in zip(ra, rl)] for ra, rl in zip(adv, logp)]


def clip_cov_parts(logp, old, adv, mask, low, high, ratio, lb, ub):
    """(PPO loss without the cut [B][T], candidate (i, t) list, number to cut)."""
    logp, old, adv, mask = tolist(logp), tolist(old), tolist(adv), tolist(mask)
    cov = covariances(logp, adv, mask)
    loss, cands = [], []
    for i, (rl, ro, ra, rm) in enumerate(zip(logp, old, adv, mask)):
        row = []
        for t, (lp, o, a, m) in enumerate(zip(rl, ro, ra, rm)):
            r = math.exp(_clamp(lp - o, -20.0, 20.0))
            l1, l2 = -a * r, -a * _clamp(r, 1 - low, 1 + high)
            row.append(max(l1, l2))
            if m and not l2 > l1 and lb < cov[i][t] < ub:
                cands.append((i, t))
        loss.append(row)
    n_valid = sum(1 for rm in mask for m in rm if m)
    return loss, cands, max(int(ratio * n_valid), 1)


def kl_cov(logp, old, adv, mask, ratio, coef):
    logp, old, adv, mask = tolist(logp), tolist(old), tolist(adv), tolist(mask)
    cov = covariances(logp, adv, mask)
    valid = [(i, t) for i, rm in enumerate(mask) for t, m in enumerate(rm) if m]
    k = max(1, int(len(valid) * ratio))
    chosen = set(sorted(valid, key=lambda it: -cov[it[0]][it[1]])[:k])  # stable: row-major on ties
    out = []
    for i, (rl, ro, ra) in enumerate(zip(logp, old, adv)):
        row = []
        for t, (lp, o, a) in enumerate(zip(rl, ro, ra)):
            d = _clamp(lp - o, -20.0, 20.0)
            row.append(-a * math.exp(d) + (coef * abs(d) if (i, t) in chosen else 0.0))
        out.append(row)
    return out


def gmpo_seq_losses(logp, old, adv, mask, low, high):
    """The paper's per-sequence loss -mean(A) * exp(mean_t pessimistic clipped log ratio)."""
    out = []
    for rl, ro, ra, rm in zip(tolist(logp), tolist(old), tolist(adv), tolist(mask)):
        terms, advs = [], []
        for lp, o, a, m in zip(rl, ro, ra, rm):
            if not m:
                continue
            d = _clamp(lp - o, -20.0, 20.0)
            s = (a > 0) - (a < 0)
            terms.append(s * min(s * d, s * _clamp(d, -low, high)))
            advs.append(a)
        out.append(-sum(advs) / len(advs) * math.exp(sum(terms) / len(terms)) if terms else 0.0)
    return out


def luspo_trl(logp, old, adv, mask, low, high):
    """TRL's luspo with sequence-level IS: mean_i(n_i * -min(s_i A_i, clip(s_i) A_i)) (A per sequence)."""
    total, rows = 0.0, list(zip(tolist(logp), tolist(old), tolist(adv), tolist(mask)))
    for rl, ro, ra, rm in rows:
        n = sum(rm)
        if not n:
            continue
        s = math.exp(sum((lp - o) for lp, o, m in zip(rl, ro, rm) if m) / n)
        a = ra[0]
        total += n * -min(s * a, _clamp(s, 1 - low, 1 + high) * a)
    return total / len(rows)


def vespo_phi(logp, old, adv, mask, k_pos, lam_pos, k_neg, lam_neg):
    out = []
    for rl, ro, ra, rm in zip(tolist(logp), tolist(old), tolist(adv), tolist(mask)):
        log_w = sum(_clamp(lp - o, -20.0, 20.0) for lp, o, m in zip(rl, ro, rm) if m)
        log_w = _clamp(log_w, math.log(1e-8), 20.0)
        row = []
        for a in ra:
            k, lam = (k_pos, lam_pos) if a >= 0 else (k_neg, lam_neg)
            row.append(math.exp(lam + k * log_w - lam * math.exp(log_w)))
        out.append(row)
    return out


# ---------------------------------------------------------------- optimal token baseline
def _otb_common(rewards, mask, old, sum_sq, is_w):
    r, m, o, q = tolist(rewards), tolist(mask), tolist(old), tolist(sum_sq)
    w = tolist(is_w) if is_w is not None else None
    returns, cum = [], []
    for i in range(len(r)):
        g, run, row_g, row_w = 0.0, 0.0, [0.0] * len(r[i]), [0.0] * len(r[i])
        for t in reversed(range(len(r[i]))):
            g += r[i][t] * m[i][t]
            row_g[t] = g
        for t in range(len(r[i])):
            step = 1 - 2 * math.exp(o[i][t]) + q[i][t]
            if w is not None:
                step *= w[i][t] ** 2
            run += step * m[i][t]
            row_w[t] = run
        returns.append(row_g)
        cum.append(row_w)
    return m, returns, cum


def _zero_tail(lengths):
    """Members' lengths -> (member position, start) for a unique longest, else None."""
    ordered = sorted(lengths)
    longest = [j for j, n in enumerate(lengths) if n == ordered[-1]]
    if len(longest) == 1 and ordered[-1] > ordered[-2]:
        return longest[0], ordered[-2]
    return None


def otb(rewards, mask, index, old, sum_sq, is_w=None, zero_tail=False, eps=1e-8):
    m, returns, cum = _otb_common(rewards, mask, old, sum_sq, is_w)
    width = len(m[0])
    base = [[0.0] * width for _ in m]
    for members in groups(index).values():
        if len(members) == 1:
            continue
        for t in range(width):
            num = sum(returns[i][t] * cum[i][t] * m[i][t] for i in members)
            den = sum(cum[i][t] * m[i][t] for i in members)
            for i in members:
                base[i][t] = num / (den + eps)
        if zero_tail:
            hit = _zero_tail([sum(m[i]) for i in members])
            if hit:
                for t in range(int(hit[1]), width):
                    base[members[hit[0]]][t] = 0.0
    adv = [[(g - b) * k for g, b, k in zip(rg, rb, rm)] for rg, rb, rm in zip(returns, base, m)]
    return adv, [[g * k for g, k in zip(rg, rm)] for rg, rm in zip(returns, m)]  # 0 in a masked hole


def tir_otb(rewards, mask, index, old, sum_sq, is_w=None, zero_tail=True, eps=1e-8):
    m, returns, cum = _otb_common(rewards, mask, old, sum_sq, is_w)
    pos = [[t for t, k in enumerate(row) if k] for row in m]  # valid positions of each row
    adv = [[0.0] * len(row) for row in m]
    for members in groups(index).values():
        members = [i for i in members if pos[i]]
        if not members:
            continue
        longest = max(len(pos[i]) for i in members)
        base = {i: [0.0] * longest for i in members}
        if len(members) > 1:
            for k in range(longest):
                have = [i for i in members if k < len(pos[i])]
                num = sum(returns[i][pos[i][k]] * cum[i][pos[i][k]] for i in have)
                den = sum(cum[i][pos[i][k]] for i in have)
                for i in members:
                    base[i][k] = num / (den + eps)
            if zero_tail:
                hit = _zero_tail([len(pos[i]) for i in members])
                if hit:
                    for k in range(hit[1], longest):
                        base[members[hit[0]]][k] = 0.0
        for i in members:
            for k, t in enumerate(pos[i]):
                adv[i][t] = returns[i][t] - base[i][k]
    return adv, [[g * k for g, k in zip(rg, rm)] for rg, rm in zip(returns, m)]  # 0 in a masked hole


# ---------------------------------------------------------------- rollout correction
def token_ratios(old, rollout, mask):
    return [
        [math.exp(_clamp(o - r, -20.0, 20.0)) if k else 0.0 for o, r, k in zip(ro, rr, rm)]
        for ro, rr, rm in zip(tolist(old), tolist(rollout), tolist(mask))
    ]


def seq_ratios(old, rollout, mask, geometric=False):
    out = []
    for ro, rr, rm in zip(tolist(old), tolist(rollout), tolist(mask)):
        logs = [o - r for o, r, k in zip(ro, rr, rm) if k]
        total = sum(logs) / max(1, len(logs)) if geometric else sum(logs)
        out.append(math.exp(_clamp(total, -20.0, 20.0)))
    return out


def correction(name, old, rollout, mask, **kw):
    """The weights / mask [B][T] each rollout-correction function should return."""
    m = tolist(mask)
    tok = token_ratios(old, rollout, mask)
    if name == "token_tis":
        return [[min(x, kw["threshold"]) if k else 0.0 for x, k in zip(rx, rm)] for rx, rm in zip(tok, m)]
    if name in ("seq_tis", "seq_mis"):
        seq = seq_ratios(old, rollout, mask, kw.get("geometric", False))
        if name == "seq_tis":
            return [[min(s, kw["threshold"]) if k else 0.0 for k in rm] for s, rm in zip(seq, m)]
        return [[1.0 if k and kw["lower"] <= s <= kw["upper"] else 0.0 for k in rm] for s, rm in zip(seq, m)]
    if name == "token_mis":
        return [
            [1.0 if k and kw["lower"] <= x <= kw["upper"] else 0.0 for x, k in zip(rx, rm)]
            for rx, rm in zip(tok, m)
        ]
    if name == "icepop":
        return [
            [x if k and kw["lower"] <= x <= kw["upper"] else 0.0 for x, k in zip(rx, rm)]
            for rx, rm in zip(tok, m)
        ]
    if name == "decoupled":
        cap = kw.get("cap") or math.inf
        return [[x if k and x <= cap else 0.0 for x, k in zip(rx, rm)] for rx, rm in zip(tok, m)]
    raise ValueError(name)
