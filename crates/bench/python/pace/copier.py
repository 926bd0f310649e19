import os
import sys
import time

os.nice(19)
path, duty, piece = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
fd = os.open(path, os.O_RDONLY)
size = os.fstat(fd).st_size
PIECE = piece
buf = bytearray(PIECE)
mv = memoryview(buf)
off = 0
while True:
    t = time.perf_counter()
    os.preadv(fd, [mv], off)
    off = (off + PIECE) % (size - PIECE)
    dt = time.perf_counter() - t
    if duty < 1:
        time.sleep(dt * (1 - duty) / duty)
