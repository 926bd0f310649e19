import os
import sys
import threading
import time

os.nice(19)
path, readers, share = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
fd = os.open(path, os.O_RDONLY)
size = os.fstat(fd).st_size
PIECE = 4 << 20


def reader(i):
    buf = bytearray(PIECE)
    mv = memoryview(buf)
    off = (i * size // readers) // PIECE * PIECE
    while True:
        c = time.thread_time()
        os.preadv(fd, [mv], off)
        off = (off + PIECE) % (size - PIECE)
        used = time.thread_time() - c
        if share < 1:
            time.sleep(used * (readers / share - 1))


ts = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(readers)]
[t.start() for t in ts]
time.sleep(1e9)
