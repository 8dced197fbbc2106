"""distributed-ext-bench: gather multi-GB shards, ours against torch's baseline, in one command.

One module per concern (the CLI: :mod:`.cli`, ``python -m distributed_ext.bench``):

- :mod:`.sizes`: sizes with units; :mod:`.resources`: memory and disk checked before any
  rank starts, the run's directory, the memory warm-up, what a rank used (peak RSS, bytes
  written and sent), the filesystem and load beside a figure; :mod:`.progress`: what dst
  shows while a method runs.
- :mod:`.methods`: the methods of each workload and their baselines, one method's figures.
- Workloads, each with what it measures, its baselines and its targets: :mod:`.gather`
  (bytes, state-dict), :mod:`.export` (an FSDP2 model and the disk), :mod:`.many` (many small
  tensors), :mod:`.tp` (a TP layout's rows), :mod:`.fsdp_tp` (torch's 2-D recipe),
  :mod:`.quantized` (a ModelOpt-quantized model beside ModelOpt's own export);
  :mod:`.measure`: the timing loop they run in the ranks.
- :mod:`.report`: the table, target verdicts, environment, JSON and plot.
"""

from distributed_ext.bench.cli import (  # noqa: F401
    main,
    parse_args,
    run_launched,
    spawn_local,
)
from distributed_ext.bench.export import (  # noqa: F401
    build_export_model,
)
from distributed_ext.bench.fsdp_tp import (  # noqa: F401
    FSDP_TP_ROUTES,
    build_fsdp_tp_model,
    format_fsdp_tp,
    measure_fsdp_tp,
)
from distributed_ext.bench.gather import (  # noqa: F401
    make_state,
)
from distributed_ext.bench.many import (  # noqa: F401
    format_many,
    measure_many,
)
from distributed_ext.bench.measure import (  # noqa: F401
    measure,
    measure_fresh,
)
from distributed_ext.bench.methods import (  # noqa: F401
    BASELINE,
    METHODS,
    Result,
    resolve_methods,
)
from distributed_ext.bench.progress import (  # noqa: F401
    ProgressBar,
    Running,
)
from distributed_ext.bench.quantized import (  # noqa: F401
    QUANTIZED_ROUTES,
    build_quantized_model,
    format_quantized,
    measure_quantized,
)
from distributed_ext.bench.report import (  # noqa: F401
    check_targets,
    conditions,
    environment,
    format_table,
    load_results,
    plot,
    report,
)
from distributed_ext.bench.resources import (  # noqa: F401
    PeakRSS,
    RankIO,
    available_bytes,
    bench_dir,
    check_memory,
    estimate_disk_bytes,
    estimate_peak_bytes,
    touch_machine_memory,
)
from distributed_ext.bench.sizes import (  # noqa: F401
    MIN_SIZE,
    WORKLOADS,
    format_size,
    parse_bytes,
    parse_size,
)
from distributed_ext.bench.tp import (  # noqa: F401
    TP_ROUTES,
    format_tp,
    measure_tp,
)
