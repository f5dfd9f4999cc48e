"""Named barrier ids of the sm90 grouped GEMM core (`grouped_gemm_sm90`); 0 is the CTA's.

EPI_BARRIER: the consumer threads of one tile meet in the epilogue (ping-pong: EPI_BARRIER + w,
MMA warpgroup w's). Ping-pong turns, each a 256-thread barrier that one warpgroup arrives at and
the other waits on: MMA_TURN + w, warpgroup w may run its mainloop; EPI_TURN + w, its epilogue.
"""

EPI_BARRIER = 1
MMA_TURN = 3
EPI_TURN = 5
