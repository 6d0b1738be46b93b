"""Summarise `layerflow bench --timeline` JSONs in two lines per length."""
import json, sys
H = ("pages_allocated", "onboard_call", "host_pinned", "signal_acquired", "copy0_issued", "all_issued",
     "prepare_end", "replay_call", "fetch_call")
for path in sys.argv[1:]:
    try:
        d = json.load(open(path))
    except Exception as e:
        print(path.rsplit("/", 1)[-1], "unreadable", type(e).__name__); continue
    dt = d["settings"]["kv_cache_dtype"][:4]
    for r in d["results"]:
        t = r.get("timeline_ms")
        if not t:
            continue
        b = d["bounds"][str(r["seq_len"])]
        extra = [p - a for p, a in zip(t["layers"], b["transfer_layers"])]
        print(f"{dt} {r['seq_len']}: lw {r['wall_ms']['median']:.3f} LB {b['lower_bound']:.3f} eff "
              f"{b['pipeline_efficiency']:.3f} | issue {t['issue_ms']:.3f} xfer +{t['transfer_ms'] - b['t_transfer']:.3f}"
              f" tail {t['tail_ms']:.3f} (last {t.get('last_compute', 0):.3f} wake {t.get('wake', 0):.3f} post "
              f"{t.get('post', 0):.3f}) lag0 {t.get('first_wait', 0):.3f} replay {t.get('replay_call', 0):.3f}")
        print("  +lay " + " ".join(f"{x * 1e3:.0f}" for x in extra) + " us | host "
              + " ".join(f"{k[:6]}={t['host.' + k]:.3f}" for k in H if "host." + k in t))
