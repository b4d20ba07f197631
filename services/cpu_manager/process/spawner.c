/* tangram-spawner FD: the process backend's spawner (see spawner.py).

   Reads spawn requests from FD, a SOCK_SEQPACKET socket to the node agent: one packet each,
   with the action's stdout and stderr pipes attached (SCM_RIGHTS). Each action is started as
   a child of the AGENT (clone with CLONE_PARENT), pinned to its CPUs before it runs anything
   of its own: the agent reaps it, watches its exit and kills its process group as it would a
   process it forked itself, while the wait for a pinned child's first turn on its CPU (a
   migration that waits for a busy core) holds this process, never the agent's event loop.

   A request is its fields, each ended by a NUL byte:
       ID CPUS CWD ARGC ARG... ENVC ENV... NPATHS PATH...
   ID a decimal request number, CPUS a kernel cpulist ("0-3,8"; empty: not pinned), PATHS
   the files to execve in turn (the program looked up in PATH by the agent, as CPython's
   subprocess does). The reply is one packet, "ID PID ERRNO STAGE": PID the child (0 if none
   was made), ERRNO 0 once the child executes its program, else why not, at STAGE: p (the
   request), k (clone), a (pin), s (setsid), f (its fds), c (chdir), x (exec). A child that
   failed has exited: the agent reaps it.

   The child: its own session, no signal blocked, stdin /dev/null, stdout and stderr the
   pipes, no other fd open, CWD its directory; then each PATH in turn, the errno of the first
   that exists but cannot run reported (ENOENT and ENOTDIR skipped), as CPython does.
   Exits 0 when FD reaches its end (the agent closed it, or died). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_REQUEST (128 * 1024)
#define MAX_ITEMS 4096
#define MAX_CPU 65535
#define STACK_SIZE (64 * 1024)

struct job {
    const char *cwd;
    cpu_set_t *cpus; /* NULL: not pinned */
    size_t cpus_size;
    char **argv, **envp, **paths;
    int out, err, devnull, report; /* report: the error pipe's close-on-exec write end */
};

static char request[MAX_REQUEST + 1];
static char *argv_[MAX_ITEMS + 1], *envp_[MAX_ITEMS + 1], *paths_[MAX_ITEMS + 1];
static char stack[STACK_SIZE] __attribute__((aligned(64)));

/* ---------------------------------------------------------------- the child (no malloc) */

__attribute__((noreturn)) static void fail(const struct job *j, char stage) {
    char msg[1 + sizeof(int)];
    int err = errno;
    msg[0] = stage;
    memcpy(msg + 1, &err, sizeof err);
    ssize_t w = write(j->report, msg, sizeof msg);
    (void)w;
    _exit(127);
}

static void close_above(int lo, int keep) {
    /* every fd from lo up but keep: close_range where the kernel has it (5.9) */
    if (keep > lo && syscall(SYS_close_range, lo, keep - 1, 0) != 0)
        for (int fd = lo; fd < keep; fd++)
            close(fd);
    if (syscall(SYS_close_range, keep + 1, ~0U, 0) != 0) {
        long top = sysconf(_SC_OPEN_MAX);
        if (top < 0 || top > 65536)
            top = 65536;
        for (int fd = keep + 1; fd < top; fd++)
            close(fd);
    }
}

static int child(void *arg) {
    const struct job *j = arg;
    if (j->cpus != NULL && sched_setaffinity(0, j->cpus_size, j->cpus) != 0)
        fail(j, 'a');
    if (setsid() < 0)
        fail(j, 's');
    if (dup2(j->devnull, 0) < 0 || dup2(j->out, 1) < 0 || dup2(j->err, 2) < 0)
        fail(j, 'f');
    close_above(3, j->report);
    if (chdir(j->cwd) != 0)
        fail(j, 'c');
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    int saved = 0;
    for (char **p = j->paths; *p != NULL; p++) {
        execve(*p, j->argv, j->envp);
        if (errno != ENOENT && errno != ENOTDIR && saved == 0)
            saved = errno;
    }
    if (saved != 0)
        errno = saved;
    fail(j, 'x');
}

/* ---------------------------------------------------------------- requests */

/* The next NUL-ended field at *at (before end), *at moved past it; NULL if there is none. */
static char *field(char **at, char *end) {
    char *start = *at;
    char *nul = memchr(start, '\0', (size_t)(end - start));
    if (nul == NULL)
        return NULL;
    *at = nul + 1;
    return start;
}

/* A count field, 0..MAX_ITEMS; -1 if it is not one. */
static long count(const char *s) {
    if (s == NULL || *s == '\0' || strlen(s) > 5)
        return -1;
    for (const char *p = s; *p; p++)
        if (*p < '0' || *p > '9')
            return -1;
    long v = strtol(s, NULL, 10);
    return v <= MAX_ITEMS ? v : -1;
}

/* n fields into list (NULL-ended); 0, or -1 if the request ends first. */
static int items(char **at, char *end, long n, char **list) {
    for (long i = 0; i < n; i++)
        if ((list[i] = field(at, end)) == NULL)
            return -1;
    list[n] = NULL;
    return 0;
}

/* A CPU number at *p (decimal, at most MAX_CPU), *p moved past it; -1 if none. */
static long cpu_at(const char **p) {
    const char *start = *p;
    long v = 0;
    for (; **p >= '0' && **p <= '9'; (*p)++)
        if ((v = v * 10 + (**p - '0')) > MAX_CPU)
            return -1;
    return *p == start ? -1 : v;
}

/* Walk the cpulist s (N or LO-HI items joined by commas), setting each CPU in set (when not
   NULL); the highest CPU, or -1 if s is not a cpulist. */
static long walk(const char *s, cpu_set_t *set, size_t size) {
    long top = -1;
    const char *p = s;
    for (;;) {
        long lo = cpu_at(&p), hi = lo;
        if (lo < 0)
            return -1;
        if (*p == '-') {
            p++;
            if ((hi = cpu_at(&p)) < lo)
                return -1;
        }
        for (long v = lo; set != NULL && v <= hi; v++)
            CPU_SET_S((size_t)v, size, set);
        if (hi > top)
            top = hi;
        if (*p == '\0')
            return top;
        if (*p++ != ',')
            return -1;
    }
}

static void reply(int sock, const char *id, pid_t pid, int err, char stage) {
    char out[96];
    int n = snprintf(out, sizeof out, "%s %d %d %c", id, (int)pid, err, stage);
    if (send(sock, out, (size_t)n, MSG_NOSIGNAL) < 0 && errno != EINTR)
        _exit(0); /* the agent is gone */
}

/* Take one request's fds out of msg: 0, or -1 (and every fd it carried closed) unless there
   are exactly two. */
static int take_fds(struct msghdr *msg, int *out, int *err) {
    int got[8], n = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c != NULL; c = CMSG_NXTHDR(msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
            if (n < 8)
                got[n++] = fd;
            else
                close(fd);
        }
    }
    if (n == 2 && !(msg->msg_flags & MSG_CTRUNC)) {
        *out = got[0];
        *err = got[1];
        return 0;
    }
    for (int i = 0; i < n; i++)
        close(got[i]);
    return -1;
}

/* Start the job's child: its pid (0 if none was made) with *err 0 and *stage '-' once it
   executes its program, else why not and where. */
static pid_t start(struct job *j, int devnull, int *err, char *stage) {
    j->argv = argv_;
    j->envp = envp_;
    j->paths = paths_;
    j->devnull = devnull;
    int pipefd[2];
    if (pipe2(pipefd, O_CLOEXEC) != 0) {
        *err = errno;
        *stage = 'k';
        return 0;
    }
    j->report = pipefd[1];
    sigset_t all, old;
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, &old);
    pid_t pid = clone(child, stack + STACK_SIZE, CLONE_VM | CLONE_VFORK | CLONE_PARENT | SIGCHLD, j);
    int clone_err = errno;
    sigprocmask(SIG_SETMASK, &old, NULL);
    close(pipefd[1]);
    if (pid < 0) {
        close(pipefd[0]);
        *err = clone_err;
        *stage = 'k';
        return 0;
    }
    char why[1 + sizeof(int)];
    ssize_t got;
    do
        got = read(pipefd[0], why, sizeof why);
    while (got < 0 && errno == EINTR);
    close(pipefd[0]);
    if (got == (ssize_t)sizeof why) {
        memcpy(err, why + 1, sizeof *err);
        *stage = why[0];
    } else {
        *err = 0;
        *stage = '-';
    }
    return pid;
}

/* Whether the agent's end is closed (a packet of no bytes reads as 0 too). */
static int hung_up(int sock) {
    struct pollfd p = {sock, POLLIN | POLLRDHUP, 0};
    return poll(&p, 1, 0) < 0 || (p.revents & (POLLHUP | POLLRDHUP | POLLERR)) != 0;
}

static void serve(int sock, int devnull) {
    static union { /* aligned as a cmsghdr must be */
        char buf[CMSG_SPACE(8 * sizeof(int))];
        struct cmsghdr align;
    } control;
    for (;;) {
        struct iovec iov = {request, MAX_REQUEST};
        struct msghdr msg = {0};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.buf;
        msg.msg_controllen = sizeof control.buf;
        ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 || (n == 0 && hung_up(sock)))
            return; /* the agent closed its end, or died */
        struct job j = {0};
        char *at = request, *end = request + n;
        request[n] = '\0';
        int fds = take_fds(&msg, &j.out, &j.err);
        char *id = field(&at, end);
        if (id == NULL || *id == '\0' || strlen(id) > 20 || strspn(id, "0123456789") != strlen(id))
            id = "0";
        char *cpus = field(&at, end);
        j.cwd = field(&at, end);
        long argc = count(field(&at, end));
        int bad = fds != 0 || (msg.msg_flags & MSG_TRUNC) || cpus == NULL || j.cwd == NULL ||
                  argc < 1 || items(&at, end, argc, argv_) != 0;
        long envc = bad ? -1 : count(field(&at, end));
        bad = bad || envc < 0 || items(&at, end, envc, envp_) != 0;
        long npaths = bad ? -1 : count(field(&at, end));
        bad = bad || npaths < 1 || items(&at, end, npaths, paths_) != 0 || at != end;
        long top = bad || *cpus == '\0' ? -1 : walk(cpus, NULL, 0);
        pid_t pid = 0;
        int err = EINVAL;
        char stage = 'p';
        if (!bad && *cpus != '\0') {
            if (top < 0) {
                bad = 1;
            } else if ((j.cpus = CPU_ALLOC(top + 1)) == NULL) {
                err = ENOMEM;
                bad = 1;
            } else {
                j.cpus_size = CPU_ALLOC_SIZE(top + 1);
                CPU_ZERO_S(j.cpus_size, j.cpus);
                walk(cpus, j.cpus, j.cpus_size);
            }
        }
        if (!bad)
            pid = start(&j, devnull, &err, &stage);
        /* the request's fds closed before the reply: once answered, nothing of it is held */
        if (fds == 0) {
            close(j.out);
            close(j.err);
        }
        if (j.cpus != NULL)
            CPU_FREE(j.cpus);
        reply(sock, id, pid, err, stage);
    }
}

int main(int argc, char **argv) {
    if (argc != 2 || strspn(argv[1], "0123456789") != strlen(argv[1]) || argv[1][0] == '\0') {
        fprintf(stderr, "usage: tangram-spawner FD\n");
        return 2;
    }
    int sock = atoi(argv[1]);
    int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (devnull < 0) {
        perror("tangram-spawner: /dev/null");
        return 1;
    }
    serve(sock, devnull);
    return 0;
}
