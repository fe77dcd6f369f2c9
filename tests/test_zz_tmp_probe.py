import os, time, pytest, resource

def _go(p, tag):
    from h3gate.cli import main
    r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = os.times(); w = time.time()
    os.write(2, f"\n@@@ START {tag}\n".encode()); open(f"/tmp/marker-{tag}-start", "w").close()
    with pytest.raises(SystemExit):
        main(["--quiet","run","ws1-model","--no-backward","--device","cpu","--seed","0","--out",str(p/"ev")])
    open(f"/tmp/marker-{tag}-end", "w").close()
    r1 = resource.getrusage(resource.RUSAGE_SELF); t1 = os.times()
    print(f"\n{tag} wall {time.time()-w:.1f} user {t1.user-t0.user:.1f} sys {t1.system-t0.system:.1f} minflt {r1.ru_minflt-r0.ru_minflt} maxrss {r1.ru_maxrss}")

@pytest.fixture
def fnfix(tmp_path):
    _go(tmp_path / "f", "FIX")

def test_a(fnfix, tmp_path):
    _go(tmp_path / "c", "CALL")
