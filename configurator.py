"""
Configuration shared by every script (nanoGPT's configurator, as an importable module).

A script declares its keys as module globals between two `# ----` lines, each with a comment:

    # -----------------------------------------------------------------------------
    ckpt = ''                   # a train.py or fold.py checkpoint
    temperature = 0.8           # 0: greedy; higher: more random
    # -----------------------------------------------------------------------------

and calls `cfg = configure(argv, globals())`. The values are, in order: the defaults, each config
file given (plain Python, executed with the current values as its namespace), then each
--key=value (a Python literal, or else the bare text); an override given before a file that sets
its key to another value, with no override of it after the file, is refused (the file would undo it
unseen). Overlays (files that set `_overlay = N`:
config/cpu.py, config/smoke.py) come after the base configs in the order of N; any other order is
refused. `-h` / `--help` prints the block above.
Every mistake ends the script with one line that names the key and the fix.
"""

import ast
import builtins
import difflib
import math
import os
import sys
import traceback
from types import ModuleType, SimpleNamespace

import torch


class ConfigError(ValueError):
    """A bad configuration: unknown key, wrong type or value, missing config file. keys: the
    configuration keys whose values the message quotes; configure adds which argument set each
    (set_by), since a value can come from a file the user did not think of."""

    def __init__(self, message, keys=()):
        super().__init__(message)
        self.keys = tuple(keys)


def check_at_least(cfg, low, keys, finite=True):
    """A validate() step: ConfigError naming the first of keys whose value in cfg (a dict) is below
    low, or NaN (e.g. batch_size=0: a traceback deep inside numpy or an executor otherwise), or,
    with finite, infinite (--weight_decay=1e400 reads as inf: the run's loss went NaN at its first
    step)."""
    for key in keys:
        if not cfg[key] >= low:
            raise ConfigError(f"{key}={cfg[key]} must be >= {low}", keys=(key,))
        if finite and cfg[key] == math.inf:
            raise ConfigError(f"{key}=inf must be a finite number >= {low}", keys=(key,))


def defaults_block(module_globals):
    """The lines between the first two `# ----` lines of the calling script: its keys with
    their defaults and comments, as `--help` prints them."""
    path = module_globals.get('__file__')
    if not path or not os.path.exists(path):
        return ''
    lines = open(path, encoding='utf-8').read().splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith('# ----')]
    return '\n'.join(lines[marks[0] + 1:marks[1]]) if len(marks) >= 2 else ''


def defaults_of(module_globals):
    """{key: default} of the script's configuration keys (bool, int, float, str globals)."""
    return {k: v for k, v in module_globals.items()
            if not k.startswith('_') and k.islower() and isinstance(v, (bool, int, float, str))}


def check_type(key, value, default, where, choices=None):
    """value if it fits the key (the type of its default, an int passes for a float; or one of
    `choices` when given), else ConfigError."""
    if choices is not None:
        if value in choices and type(value) in {type(c) for c in choices}:
            return value
        raise ConfigError(f"{where}: {key}={value!r}: choose one of {', '.join(map(repr, choices))}")
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not type(default):
        # Python's spellings: --compile=false or =1 (other tools' habits) would otherwise read as a type puzzle
        how = f": write {key}=True or {key}=False" if isinstance(default, bool) else ''
        raise ConfigError(f"{where}: {key}={value!r} is of type {type(value).__name__}, "
                          f"expected {type(default).__name__} like the default {default!r}{how}")
    return value


# names other training scripts use for a key of ours, which spelling distance alone misses
ALIASES = {'lr': 'learning_rate', 'steps': 'max_iters', 'iters': 'max_iters', 'bs': 'batch_size',
           'wd': 'weight_decay', 'seq_len': 'block_size', 'context_length': 'block_size',
           'd_model': 'n_embd', 'n_layers': 'n_layer', 'n_heads': 'n_head', 'lambda': 'aux_weight'}


def unknown_key(key, known, where):
    close = [ALIASES[key]] if ALIASES.get(key) in known else difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean --{close[0]}?" if close else "; -h lists the keys"
    return ConfigError(f"{where}: unknown config key {key!r}{hint}")


def config_error(path, e):
    """The ConfigError for exception e raised while parsing or running config file path: its file,
    its line (a SyntaxError's own, else the deepest traceback frame in the file) and e."""
    if isinstance(e, SyntaxError):
        line, what = e.lineno, f"{type(e).__name__}: {e.msg}"
    else:
        line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == path), None)
        what = f"{type(e).__name__}: {e}"
    return ConfigError(f"config file {path}{f', line {line}' if line else ''}: {what} (config files run as "
                       f"Python: correct the file)")


def read_config(path):
    """The source of config file path; ConfigError (config_error) where it is not Python."""
    try:
        with open(path, encoding='utf-8') as f:  # not utf-8-sig, whose errors count bytes after the mark
            source = f.read().removeprefix('\ufeff')  # Python runs a file saved with a byte-order mark: so do we
        ast.parse(source, path)
    except (SyntaxError, ValueError) as e:  # ValueError: not UTF-8, or a NUL byte
        raise config_error(path, e) from None
    return source


def overlay_rank(path):
    """A config file's place in the order files are given: the number it assigns to `_overlay` at
    its top level (config/cpu.py 1, config/smoke.py 2: an overlay changes what the files before
    it set), 0 for a base config. Read from the source, without running it; ConfigError naming
    the file and line where it is not Python."""
    tree = ast.parse(read_config(path), path)
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and any(isinstance(t, ast.Name) and t.id == '_overlay' for t in node.targets)):
            return int(node.value.value)
    return 0


def assigned_keys(path):
    """The names a config file assigns at its top level (config/smoke.py: max_iters, ...), read
    from the source without running it."""
    tree = ast.parse(read_config(path), path)
    return {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
            if isinstance(t, ast.Name)}


def config_files(args):
    """The config files among a script's arguments, in the order given (the rest are --key=value)."""
    return [a for a in args if not a.startswith('-') and os.path.isfile(a)]


def working_order(args):
    """args in the order that configure applies as meant: the config files in overlay_rank order
    (sorted is stable: the base configs keep theirs), then every --key=value in its order."""
    files = config_files(args)
    return sorted(files, key=overlay_rank) + [a for a in args if a not in files]


def check_overlay_order(args):
    """ConfigError unless the config files among args come in overlay_rank order (base configs,
    then config/cpu.py, then config/smoke.py): a file applied out of order would undo or rescale
    another. The message gives every argument back in the order that works."""
    files = config_files(args)
    ranks = [overlay_rank(f) for f in files]
    for i in range(1, len(files)):
        early = max(range(i), key=lambda j: ranks[j])  # the overlay that file i should precede
        if ranks[i] < ranks[early]:
            what = (f"{files[i]} comes after the overlay {files[early]} and would undo it" if ranks[i] == 0 else
                    f"the overlay {files[i]} comes after {files[early]}, which must follow it")
            raise ConfigError(f"{what}: give base configs first, then the overlays (config/cpu.py before "
                              f"config/smoke.py): {' '.join(working_order(args))}")


PROSE_KEYS = ('start', 'title', 'labels')  # text keys that are not paths: sample.py's prompt, plot.py's words


def home(key, value):
    """value with a leading ~ or ~user expanded (os.path.expanduser), for a text key outside PROSE_KEYS.
    The shell expands ~ only at the start of a word, never in --out_dir=~/runs, and a config file's
    string is never expanded: taken as it is, such a path made a folder named '~' in the current one."""
    return os.path.expanduser(value) if isinstance(value, str) and value[:1] == '~' and key not in PROSE_KEYS else value


def check_out_file(out, what, example):
    """ConfigError if --out=out names a folder (one that exists, or a path ending in a separator):
    the scripts' --out is a file (`what`, e.g. 'the image'), and writing it there failed late or
    wrote beside it. The error's fix is os.path.join(out, example)."""
    if os.path.isdir(out) or out.endswith(('/', os.sep)):
        raise ConfigError(f"--out={out} names a folder: --out is {what} to write, e.g. "
                          f"--out={os.path.join(out, example)}")


def parse_args(args, defaults, choices=None, fill=('out_dir',), origins=None):
    """defaults → config files → --key=value, in the order given; returns a new dict. A
    --key=value before a config file that sets key to another value, and not given again after
    it, is refused: the file would undo the override without a word (nanoGPT's configurator lets it).

    choices: {key: allowed values} for keys that are choices rather than a type (e.g. compile:
    'auto', True, False). fill: string keys whose {key} placeholders are filled from the final
    values ('out-{dataset}-{taper}'). A value is read as a Python literal, or else kept as
    text; a key whose default is a string always keeps the text (a prompt is never a literal),
    with a leading ~ expanded to the home folder (`home`).
    origins: a dict to fill with {key: the argument that set it last}, as given ('config/cpu.py',
    '--max_iters=300'; a config file counts where it changed the value). Raises ConfigError
    naming the key or argument.
    """
    choices = choices or {}
    cfg, overridden = dict(defaults), {}  # overridden: {key: the --key=value that set it}
    check_overlay_order(args)
    for i, arg in enumerate(args):
        if arg.startswith('--'):
            key, eq, text = arg[2:].partition('=')
            if not eq:
                raise ConfigError(f"{arg}: overrides are written --key=value")
            if key not in cfg:
                raise unknown_key(key, cfg, arg)
            if isinstance(defaults[key], str) and key not in choices:
                value = home(key, text)  # --start='"quoted"' keeps its quotes, --start=1984 is text
            else:
                try:
                    value = ast.literal_eval(text)
                except (SyntaxError, ValueError):
                    value = text  # a bare word is a string: --compile=auto
            cfg[key] = check_type(key, value, defaults[key], arg, choices.get(key))
            overridden[key] = arg
            if origins is not None:
                origins[key] = arg
        elif '=' in arg and arg.lstrip('-').partition('=')[0].isidentifier() and not os.path.isfile(arg):
            raise ConfigError(f"{arg}: did you mean --{arg.lstrip('-')}? Overrides start with two dashes")
        elif not os.path.isfile(arg):
            if arg.endswith('.py'):
                shipped = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'config', os.path.basename(arg))
                hint = f": did you mean {os.path.relpath(shipped)}?" if os.path.isfile(shipped) else ''
                raise ConfigError(f"config file {arg!r} not found (paths are relative to the current folder){hint}")
            raise ConfigError(f"{arg!r} is neither a config file nor --key=value; a value with spaces "
                              f"needs quotes, e.g. --start='It was a'")
        else:
            namespace = dict(cfg, __file__=os.path.abspath(arg))
            source = read_config(arg)
            try:
                exec(builtins.compile(source, arg, 'exec'), namespace)
            except Exception as e:  # NameError, TypeError, ...: whatever the file's own code raises
                raise config_error(arg, e) from None
            for key, value in namespace.items():
                if key.startswith('_') or isinstance(value, ModuleType) or callable(value):
                    continue
                if key not in cfg:
                    raise unknown_key(key, cfg, f"config file {arg}")
                value = check_type(key, home(key, value), defaults[key], arg, choices.get(key))
                changed = type(value) is not type(cfg[key]) or value != cfg[key]
                if changed and key in overridden and not any(a.startswith(f'--{key}=') for a in args[i + 1:]):
                    raise ConfigError(f"{overridden[key]} comes before {arg}, which sets {key} again and would "
                                      f"undo it: give the config files first, then the --key=value overrides: "
                                      f"{' '.join(working_order(args))}")
                if origins is not None and changed:
                    origins[key] = arg
                cfg[key] = value
    for key in fill:
        if key in cfg:
            try:
                cfg[key] = cfg[key].format(**cfg)
            except (KeyError, ValueError, IndexError) as e:
                raise ConfigError(f"{key}={cfg[key]!r}: placeholders must be config keys, like "
                                  f"{{taper}} ({type(e).__name__}: {e})")
    return cfg


def set_by(origins, keys):
    """'; set by config/cpu.py (gate_warmup_iters, taper_iters), --max_iters=300 (max_iters)': which
    argument set each of keys (origins from parse_args; 'the defaults' for those none set), for a
    message that quotes values the user may not have typed; '' for no keys."""
    by = {}
    for key in keys:
        by.setdefault(origins.get(key, 'the defaults'), []).append(key)
    return '; set by ' + ', '.join(f"{arg} ({', '.join(ks)})" for arg, ks in by.items()) if by else ''


def configure(argv, module_globals, choices=None, validate=None):
    """The configuration of the calling script as a SimpleNamespace (see parse_args), after
    validate(cfg dict) when given (it raises ConfigError). -h / --help prints the script's
    docstring and keys and exits 0; a ConfigError exits with its one-line message, which names
    the arguments that set the keys it quotes (ConfigError.keys, set_by)."""
    if '-h' in argv or '--help' in argv:
        print((module_globals.get('__doc__') or '').strip() + '\n\nkeys (--key=value):\n'
              + defaults_block(module_globals))
        raise SystemExit(0)
    origins = {}
    try:
        cfg = parse_args(argv, defaults_of(module_globals), choices, origins=origins)
        if 'seed' in cfg and not 0 <= cfg['seed'] < 2 ** 63:  # every script's seed seeds torch and numpy
            raise ConfigError(f"seed={cfg['seed']} must be in [0, 2**63): torch and numpy take no other", ('seed',))
        if validate is not None:
            validate(cfg)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}{set_by(origins, e.keys)}")
    return SimpleNamespace(**cfg)


def run_command(main):
    """main(sys.argv[1:]), for a script's `if __name__ == '__main__'`. Its output piped into a reader
    that stops early (`python sample.py ... | head`) ends it quietly with status 1, as Python's
    documentation advises for EPIPE, not with a BrokenPipeError traceback. A character its stdout's
    encoding lacks (λ, γ̃, Δ, generated text: a file on Windows is cp1252) is written as an escape
    such as \\u03bb, as stderr does by default, not raised as a UnicodeEncodeError mid-run. Ctrl-C
    that reaches it (outside a training run, which handles its own signals: a GPT-2 download,
    sampling, a benchmark) is one line and status 130, not a KeyboardInterrupt traceback."""
    if hasattr(sys.stdout, 'reconfigure'):  # a TextIOWrapper (a StringIO put in its place has none)
        sys.stdout.reconfigure(errors='backslashreplace')
    try:
        main(sys.argv[1:])
        sys.stdout.flush()  # the last buffered output is written here, inside the try
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's own flush at exit
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print("stopped by SIGINT (Ctrl-C)", file=sys.stderr)
        raise SystemExit(130) from None


# what inductor, torch.compile's default backend, builds its kernels with on each kind of device
COMPILER_NEEDS = {'cpu': "inductor builds C++ on the CPU: it needs a working C++ compiler (g++, clang++ or $CXX)",
                  'cuda': "inductor builds Triton kernels on CUDA: it needs the triton package matching this torch"}


def cache_fault(error):
    """Whether a failed compile failed at its cache folder, not at the compiler: a file-system
    error (no such folder, no permission) or a built kernel the loader may not map (noexec), in
    the exception or what it was raised from (its __cause__s: not __context__, which would blame
    an OSError that inductor had handled)."""
    while error is not None:
        if isinstance(error, OSError) or 'failed to map segment' in str(error):
            return True
        error = error.__cause__
    return False


def inductor_cache():
    """The folder inductor compiles into (TORCHINDUCTOR_CACHE_DIR, or its default under the temp folder)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir  # private: moved before, may again
        return cache_dir()
    except Exception:
        return os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'its cache folder (TORCHINDUCTOR_CACHE_DIR)')


def check_compiler(device, off='--compile=False'):
    """SystemExit with one line unless torch.compile works on device (inductor needs a C++ compiler
    on the CPU, Triton on CUDA): compiles a one-line function once, a second or two. Every script
    that compiles calls it before its first model work, so that a machine without a compiler (a Mac
    without Xcode's command-line tools) gets this line, not inductor's traceback minutes later.
    off: the setting that runs without compiling, named in the message."""
    try:
        torch.compile(lambda x: x * 2 + 1, fullgraph=True)(torch.ones(2, device=device))
    except Exception as e:  # inductor raises many kinds; the first line of its message says which
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        need = COMPILER_NEEDS.get(torch.device(device).type, "inductor could not build kernels for it with this torch")
        if cache_fault(e):  # pytorch#91005, #123054: not the compiler, where its output goes
            need = (f"inductor writes its kernels to {inductor_cache()} and loads them from there: set "
                    "TORCHINDUCTOR_CACHE_DIR to a folder you can write, on a file system not mounted noexec")
        raise SystemExit(f"config error: torch.compile does not work on {device} here ({first[:200]}); "
                         f"{need}; {off} runs without it") from None


def resolve_device(device, dtype='auto', local_rank=None):
    """(device string, dtype name) from the shared settings; SystemExit with one line if unusable.

    device: 'auto' (cuda, else mps, else cpu), 'cpu', 'cuda', 'cuda:N' or 'mps'. dtype: 'auto'
    (bfloat16 on a CUDA device that supports it, else float32), 'float32', 'bfloat16', 'float16'.
    A CUDA device always comes back with its index: 'cuda' is the current device ('cuda:0' unless
    set), and under DDP (local_rank given) every CUDA device is the rank's own, 'cuda:<local_rank>'
    (without asking CUDA which is current: that would touch device 0 from every rank). torch.cuda
    calls that take a device (set_device, ...) refuse one without an index. An index the machine
    lacks (torch.cuda.device_count(); under DDP a local_rank beyond it) is a SystemExit naming the
    devices there are.
    """
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else 'mps' if torch.backends.mps.is_available() else 'cpu'
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ('cpu', 'cuda', 'mps'):
        raise SystemExit(f"config error: device={device!r}: use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'")
    if kind == 'cuda' and not torch.cuda.is_available():
        raise SystemExit(f"config error: device={device!r}: this machine has no CUDA device; use --device=cpu")
    if kind == 'mps' and not torch.backends.mps.is_available():
        raise SystemExit(f"config error: device={device!r}: this torch build or machine has no MPS "
                         "(Apple GPU) support; use --device=cpu")
    if kind == 'cuda':
        index = local_rank if local_rank is not None else torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        count = torch.cuda.device_count()
        if index >= count:  # refused here: torch.cuda.set_device would raise "invalid device ordinal"
            have = (f"{count} CUDA device{'s' * (count > 1)}, "
                    + ('cuda:0' if count == 1 else f'cuda:0 to cuda:{count - 1}'))
            if local_rank is not None:
                raise SystemExit(f"config error: LOCAL_RANK={local_rank} (torchrun) but this machine has {have}: "
                                 f"start at most {count} process{'es' * (count > 1)} per machine "
                                 f"(torchrun --nproc_per_node={count})")
            raise SystemExit(f"config error: device={device!r}: this machine has {have}; use one of those")
        device = f'cuda:{index}'
    if dtype == 'auto':
        # bf16 natively from Ampere (sm 8.0) on; torch.cuda.is_bf16_supported() also says yes to older
        # GPUs that emulate it slowly (and asks the current device, not this one)
        dtype = 'bfloat16' if kind == 'cuda' and torch.cuda.get_device_capability(device) >= (8, 0) else 'float32'
    if dtype not in ('float32', 'bfloat16', 'float16'):
        raise SystemExit(f"config error: dtype={dtype!r}: choose 'auto', 'float32', 'bfloat16' or 'float16'")
    return device, dtype


def uses_tf32(device, dtype):
    """Whether a run on device in dtype computes with TF32 matmuls: on a CUDA device in a 16-bit
    dtype (its matmuls round to bf16 already; TF32, 10 mantissa bits, is finer, for the products
    autocast leaves in fp32), never in float32, which means IEEE float32 products. What set_tf32
    sets and the runs' records (bench, train, study) say."""
    return torch.device(device).type == 'cuda' and dtype != 'float32'


def set_tf32(device, dtype):
    """Set torch's process-wide TF32 flags (cuBLAS matmul, cuDNN) to uses_tf32(device, dtype):
    whatever ran before in the process (an earlier train.main in the same pytest process) leaves nothing. Returns it."""
    on = uses_tf32(device, dtype)
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    return on


def changed_keys(cfg, defaults, leave_out=()):
    """'key=value key=value ...': the keys of the configuration dict cfg whose values differ from
    defaults, in the defaults' order (strings quoted), leaving out `leave_out` (keys a caller shows
    already); '' when none differs. What a run's header prints so that a reader sees every key changed."""
    return ' '.join(f"{k}={cfg[k]!r}" for k in defaults
                    if k not in leave_out and (type(cfg[k]) is not type(defaults[k]) or cfg[k] != defaults[k]))


def keys_set(argv, defaults, keys, choices=None):
    """The keys among `keys` that argv's config files or --key=value overrides set, even to their
    default value: those whose final value does not depend on the default. argv is parsed a second
    time with each of those defaults changed (bool negated, number + 1, text + a NUL), and a key
    keeps its value in both parses only if argv gave it. Raises ConfigError as parse_args does."""
    def other(value):
        if isinstance(value, bool):
            return not value
        return value + 1 if isinstance(value, (int, float)) else value + '\0'

    first = parse_args(argv, defaults, choices)
    second = parse_args(argv, {**defaults, **{k: other(defaults[k]) for k in keys}}, choices)
    return {k for k in keys if first[k] == second[k]}
