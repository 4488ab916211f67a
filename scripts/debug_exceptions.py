"""Which C++ error path crashes on this machine: the extension's own checks, or any extension's?"""
import subprocess, sys, textwrap

CASES = {
    "ext_cpu_tensor": "op([p.cpu()], [p.cpu()], [p.cpu()], [k.cpu()], [None], [None], [0], [1], **a)",
    "ext_bad_shape": "op([p], [torch.randn(5, 4, device='cuda')], [p.clone()], [k], [None], [None], [0], [1], **a)",
    "ext_good": "op([p], [p.clone()], [p.clone()], [k], [None], [None], [0], [1], **a); torch.cuda.synchronize()",
    "inline_cpp_throw": "inline()",
}
PRE = textwrap.dedent('''
    import faulthandler, torch; faulthandler.enable()
    from lightning_cafin.kernels import load_extension
    op = load_extension().adafisher_step_
    p = torch.randn(4, 5, device="cuda"); k = torch.zeros((), device="cuda")
    a = dict(lr=1e-3, beta=0.9, Lambda=1e-3, weight_decay=0.0, decoupled=False)
    def inline():
        from torch.utils.cpp_extension import load_inline
        m = load_inline("cafin_throw", cpp_sources="void boom(){ TORCH_CHECK(false, \\"boom\\"); }", functions=["boom"])
        m.boom()
''')
for name, call in CASES.items():
    code = PRE + f"\ntry:\n    {call}\n    print('{name}: no error')\nexcept Exception as e:\n    print('{name}: raised', type(e).__name__, str(e).splitlines()[0][:120])\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print(name, "rc", r.returncode, r.stdout.strip().splitlines()[-1:] , r.stderr.strip().splitlines()[:3])
