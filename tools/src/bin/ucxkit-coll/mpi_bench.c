/* The MPI side of `ucxkit-coll --compare mpi`: the same operations, sizes and
 * iteration counts, timed the same way (a barrier, then `iters` calls, the slowest
 * rank's mean), printed by rank 0 as one JSON object per line.
 *
 *   mpi_bench OPS SIZES DTYPE ITERS WARMUP ROOT REDOP
 *   (OPS and SIZES comma-separated; sizes in bytes, as ucxkit-coll counts them; ITERS one
 *   count, or a comma-separated count per size (the last repeated for sizes beyond it);
 *   REDOP one of sum, prod, min, max, band, bor, bxor) */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static MPI_Datatype dtype_of(const char *d, size_t *elem) {
    struct { const char *n; MPI_Datatype t; size_t s; } m[] = {
        {"i8", MPI_INT8_T, 1},   {"i16", MPI_INT16_T, 2},   {"i32", MPI_INT32_T, 4},   {"i64", MPI_INT64_T, 8},
        {"u8", MPI_UINT8_T, 1},  {"u16", MPI_UINT16_T, 2},  {"u32", MPI_UINT32_T, 4},  {"u64", MPI_UINT64_T, 8},
        {"f32", MPI_FLOAT, 4},   {"f64", MPI_DOUBLE, 8},
    };
    for (size_t i = 0; i < sizeof m / sizeof m[0]; i++)
        if (!strcmp(m[i].n, d)) { *elem = m[i].s; return m[i].t; }
    return MPI_DATATYPE_NULL;
}

static MPI_Op op_of(const char *r) {
    struct { const char *n; MPI_Op o; } m[] = {
        {"sum", MPI_SUM}, {"prod", MPI_PROD}, {"min", MPI_MIN}, {"max", MPI_MAX},
        {"band", MPI_BAND}, {"bor", MPI_BOR}, {"bxor", MPI_BXOR},
    };
    for (size_t i = 0; i < sizeof m / sizeof m[0]; i++)
        if (!strcmp(m[i].n, r)) return m[i].o;
    return MPI_OP_NULL;
}

/* The reduction of the run (REDOP). */
static MPI_Op redop = MPI_OP_NULL;

/* One call of `op` on `count` elements (the operation's larger buffer, as
 * ucxkit-coll sizes it). */
static int run(const char *op, char *a, char *b, size_t count, size_t elem, MPI_Datatype t, int np, int root) {
    int per = (int)(count / np);
    if (!strcmp(op, "allreduce")) return MPI_Allreduce(a, b, (int)count, t, redop, MPI_COMM_WORLD);
    if (!strcmp(op, "broadcast")) return MPI_Bcast(a, (int)count, t, root, MPI_COMM_WORLD);
    if (!strcmp(op, "reduce")) return MPI_Reduce(a, b, (int)count, t, redop, root, MPI_COMM_WORLD);
    if (!strcmp(op, "allgather")) return MPI_Allgather(a, per, t, b, per, t, MPI_COMM_WORLD);
    if (!strcmp(op, "reduce_scatter")) return MPI_Reduce_scatter_block(a, b, per, t, redop, MPI_COMM_WORLD);
    if (!strcmp(op, "alltoall")) return MPI_Alltoall(a, per, t, b, per, t, MPI_COMM_WORLD);
    if (!strcmp(op, "gather")) return MPI_Gather(a, per, t, b, per, t, root, MPI_COMM_WORLD);
    if (!strcmp(op, "scatter")) return MPI_Scatter(a, per, t, b, per, t, root, MPI_COMM_WORLD);
    if (!strcmp(op, "barrier")) return MPI_Barrier(MPI_COMM_WORLD);
    if (!strcmp(op, "scan")) return MPI_Scan(a, b, (int)count, t, redop, MPI_COMM_WORLD);
    (void)elem;
    return -1;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, np;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &np);
    if (argc != 8) {
        if (rank == 0) fprintf(stderr, "usage: mpi_bench OPS SIZES DTYPE ITERS WARMUP ROOT REDOP\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    redop = op_of(argv[7]);
    if (redop == MPI_OP_NULL) {
        if (rank == 0) fprintf(stderr, "mpi_bench: no MPI reduction %s\n", argv[7]);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    /* Idle before the first cell, as ucxkit's ranks do (SETTLE in rank.rs). */
    usleep(150000);
    MPI_Barrier(MPI_COMM_WORLD);
    size_t elem;
    MPI_Datatype t = dtype_of(argv[3], &elem);
    if (t == MPI_DATATYPE_NULL) {
        if (rank == 0) fprintf(stderr, "mpi_bench: no MPI type for %s\n", argv[3]);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    long warmup = atol(argv[5]);
    int root = atoi(argv[6]);
    char *ops = strdup(argv[1]);
    for (char *op = strtok(ops, ","); op; op = strtok(NULL, ",")) {
        char *sizes = strdup(argv[2]), *save = NULL;
        const char *next_iters = argv[4];
        long iters = 1;
        for (char *s = strtok_r(sizes, ",", &save); s; s = strtok_r(NULL, ",", &save)) {
            if (*next_iters) {
                char *end;
                iters = strtol(next_iters, &end, 10);
                next_iters = *end == ',' ? end + 1 : end;
            }
            if (iters < 1) iters = 1;
            size_t bytes = strtoull(s, NULL, 10), count = bytes / elem;
            char *a = malloc((count ? count : 1) * elem), *b = malloc((count ? count : 1) * elem);
            /* Written, as ucxkit-coll's buffers are: untouched calloc memory maps every
             * page to the kernel's one zero page, and reading it is nearly free. */
            memset(a, 1, (count ? count : 1) * elem);
            memset(b, 1, (count ? count : 1) * elem);
            for (long i = 0; i < warmup; i++) run(op, a, b, count, elem, t, np, root);
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            for (long i = 0; i < iters; i++)
                if (run(op, a, b, count, elem, t, np, root) != MPI_SUCCESS) MPI_Abort(MPI_COMM_WORLD, 3);
            double mine = (MPI_Wtime() - t0) / (double)iters, slowest;
            MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (rank == 0)
                printf("{\"op\":\"%s\",\"bytes\":%zu,\"np\":%d,\"dtype\":\"%s\",\"time_us\":%.4f,\"iters\":%ld}\n", op,
                       bytes, np, argv[3], slowest * 1e6, iters);
            fflush(stdout);
            free(a);
            free(b);
        }
        free(sizes);
    }
    free(ops);
    MPI_Finalize();
    return 0;
}
