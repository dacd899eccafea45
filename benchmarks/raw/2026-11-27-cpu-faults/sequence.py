"""Issue #58's compound sequence: 50 clients, 20 rounds, int8 uploads, 25 % dropout; client actors
killed inside rounds 5 and 10, driver stopped after round 12 and resumed, a client actor killed in
round 17; against an undisturbed run: bitwise final state, one FINISHED MLflow run, every round's
metrics once, no process left. Imports fedsweep's public ``fedsweep.bench.api`` since 2026-11-28 (as run
on 2026-11-27: ``git show a5670ad:benchmarks/raw/2026-11-27-cpu-faults/sequence.py``)."""
import sys, time, json
import psutil
from mlflow.tracking import MlflowClient
from fedsweep.bench.api import Disturber, Kill, RunError, Timeline, bitwise_equal, final_state, load_config
from fedsweep.bench.api import run_experiment as run

K, R = int(sys.argv[1]), int(sys.argv[2])
out = sys.argv[3]
kills = [Kill(5, "client", 0), Kill(10, "client", 3), Kill(12, "driver"), Kill(17, "client", 1)] if R == 20 else \
        [Kill(2, "client", 0), Kill(4, "client", 1), Kill(5, "driver"), Kill(7, "client", 0)]
sets = ["data.examples_per_task=160", "partition.scheme=iid", f"clients.num_clients={K}", f"rounds={R}",
        "clients.upload.compression=int8", "clients.dropout=0.25", "eval.max_new_tokens=0", "train.steps=2",
        f"tracking.uri=sqlite:///{out}/mlflow.db", "clients.clients_per_actor=" + str(max(1, K // 2))]
def cfg(name):
    return load_config("configs/experiments/smoke.yaml", sets + [f"checkpoint.dir={out}/{name}", f"tracking.experiment={name}"])
t0 = time.time()
calm = run(cfg("undisturbed"))
print("undisturbed", round(time.time() - t0, 1), "s", flush=True)
tl = Timeline(); d = Disturber(kills, tl); c = cfg("disturbed"); resume = False; outs = []
t1 = time.time()
for stop in [k.round for k in kills if k.kind == "driver"] + [None]:
    try:
        outs.append(run(c, resume=resume, on_event=d, stop_after=stop))
    except RunError as e:
        if "stop_after" not in str(e): raise
        print("driver stopped after", stop, flush=True)
    resume = True
print("disturbed", round(time.time() - t1, 1), "s", [(k.kind, k.round, k.landed) for k in kills], flush=True)
a, b = final_state(calm.run_dir), final_state(outs[-1].run_dir)
diff = [k for k in a if k not in b or not bitwise_equal(a[k], b[k])]
client = MlflowClient(f"sqlite:///{out}/mlflow.db")
runs = client.search_runs([client.get_experiment_by_name("disturbed").experiment_id])
hist = [m.step for m in client.get_metric_history(outs[-1].run_id, "train_loss")]
children = [p for p in psutil.Process().children(recursive=True)]
print(json.dumps({"clients": K, "rounds": R, "tensors": len(a), "bitwise_equal": not diff, "differing": diff[:5],
                  "mlflow_runs": [(r.info.status) for r in runs], "train_loss_steps": hist,
                  "kills": [(k.kind, k.round, k.landed) for k in kills]}))
