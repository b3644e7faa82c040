"""Short CPU bursts at nice 0, like a server's other processes: busy B ms, then sleep S ms, in T threads."""
import sys
import threading
import time

busy, sleep, nthreads = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3, int(sys.argv[3])
def run():
    while True:
        t = time.perf_counter()
        while time.perf_counter() - t < busy:
            pass
        time.sleep(sleep)
for _ in range(nthreads):
    threading.Thread(target=run, daemon=True).start()
time.sleep(float(sys.argv[4]))
