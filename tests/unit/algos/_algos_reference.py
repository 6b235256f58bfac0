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
