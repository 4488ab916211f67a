"""Which C++ error path crashes on this machine: the extension's own checks, or any extension's?

Each case runs in a fresh process.  ``--gdb CASE`` reruns one case under cuda-gdb (batch
mode) and prints the native backtrace of a crash.  Finding (H200 machine, torch 2.11): the
crash was a SIGSEGV in std::basic_ostream::_M_insert<long> inside the extension, i.e.
streaming a number into a check message; the ops now format numbers with std::to_string.
"""
import shutil, subprocess, sys, textwrap

CASES = {
    "ext_cpu_tensor": "op([p.cpu()], [p.cpu()], [p.cpu()], [k.cpu()], [None], [None], [0], [1], **a)",
    "ext_bad_shape": "op([p], [torch.randn(5, 4, device='cuda')], [p.clone()], [k], [None], [None], [0], [1], **a)",
    "bad_beta": "op([p], [p.clone()], [p.clone()], [k], [None], [None], [0], [1], **dict(a, beta=1.5))",
    "capture_bad_dim": "ext.channel_stats(p, 5, True, 0.0)",
    "capture_bad_factor": "ext.factor_update_([p[0]], [p[0]], [p[0]], [p[1, :3]], [0], [0], [1.0], [1.0], [1.0], [0.0], 0.08, 0.008)",
    "ext_good": "op([p], [p.clone()], [p.clone()], [k], [None], [None], [0], [1], **a); torch.cuda.synchronize()",
    "inline_cpp_throw": "inline()",
}
PRE = textwrap.dedent('''
    import faulthandler, torch; faulthandler.enable()
    from lightning_cafin.kernels import load_extension
    ext = load_extension(); op = ext.adafisher_step_
    p = torch.randn(4, 5, device="cuda"); k = torch.zeros((), device="cuda")
    a = dict(lr=1e-3, beta=0.9, Lambda=1e-3, weight_decay=0.0, decoupled=False)
    def inline():
        from torch.utils.cpp_extension import load_inline
        m = load_inline("cafin_throw", cpp_sources="void boom(){ TORCH_CHECK(false, \\"boom\\"); }", functions=["boom"])
        m.boom()
''')


def code_for(name):
    call = CASES[name]
    return PRE + f"\ntry:\n    {call}\n    print('{name}: no error')\nexcept Exception as e:\n    print('{name}: raised', type(e).__name__, str(e).splitlines()[0][:120])\n"


if len(sys.argv) == 3 and sys.argv[1] == "--gdb":
    gdb = shutil.which("cuda-gdb") or "/usr/local/cuda/bin/cuda-gdb"
    r = subprocess.run([gdb, "-batch", "-ex", "run", "-ex", "bt 40", "--args", sys.executable, "-c", code_for(sys.argv[2])],
                       capture_output=True, text=True, timeout=300)
    print(r.stdout[-12000:], r.stderr[-3000:])
    sys.exit(0)
for name in (sys.argv[1:] or CASES):
    r = subprocess.run([sys.executable, "-c", code_for(name)], capture_output=True, text=True)
    print(name, "rc", r.returncode, r.stdout.strip().splitlines()[-1:], r.stderr.strip().splitlines()[:3])
