# The fork server's warm modules imported with the cyclic collector on or off: .venv/bin/python benchmarks/raw/2026-11-30-cpu-setup-collector/imports_collector.py on|off (prints: wall s, CPU s, full collections)
import sys, time, gc
if sys.argv[1] == "off": gc.disable()
t = time.perf_counter(); c0 = time.process_time()
import importlib
for m in ('torch', 'transformers.models.llama.modeling_llama', 'peft', 'fedsweep.actors.engine_setup','fedsweep.actors.client_training', 'fedsweep.actors.client_eval', 'fedsweep.algorithms.registry'):
    importlib.import_module(m)
print(sys.argv[1], round(time.perf_counter()-t,2), round(time.process_time()-c0,2), gc.get_stats()[2]['collections'])
