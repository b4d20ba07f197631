/* tangram-dropuid [-c CPUS] UID GID [NAME=VALUE...] -- PROGRAM [ARG...]
   tangram-dropuid -k UID GID

   Runs PROGRAM (looked up in PATH) as UID:GID with no supplementary groups and no_new_privs:
   what `setpriv --reuid=UID --regid=GID --clear-groups --no-new-privs --` does, without
   setpriv's start-up (about 1.2 ms of CPU an action here, against 0.4 ms for this). Built
   statically (no dynamic loader runs as root) by services/cpu_manager/process/dropuid.py; the
   process backend runs every action of a trajectory through it when the agent is root.

   The NAME=VALUE pairs are set only once root is gone: the backend passes the variables the
   C library would act on in a privileged process (LD_PRELOAD, GLIBC_TUNABLES, ...) this way
   rather than in this program's own environment.

   With -c it first pins itself to CPUS (a kernel cpulist, as services/cpu_manager/cpulist.py
   writes it: decimal CPU numbers and ascending ranges joined by commas, "0-3,8"), so
   PROGRAM and everything it starts run on those CPUs from PROGRAM's first instruction: the
   backend need not move its own thread onto the action's cores to spawn it there (a
   migration that waits for the target core, a quarter of the agent's time under load).

   PROGRAM is looked up in PATH as execve(2) and CPython's subprocess do it, not as execvp(3)
   (which would run a file without a #! line through /bin/sh): a file that cannot be executed
   is 126 whichever way the backend starts it.

   With -k it runs no program: as UID:GID it sends SIGKILL to every process of UID
   (kill(2) with pid -1 reaches all the caller may signal, itself excepted, at once: a process
   that keeps forking cannot escape it as it escapes a scan of the process table). The
   backend rids a trajectory's uid of its leftovers so when the trajectory ends and before the
   uid goes to another: one exec of this, where `sh -c 'kill -KILL -1'` through it cost two.
   Exit 0 when none was left or all were signalled.

   UID and GID are decimal, 1 to 4294967294 (0 is root, 4294967295 means "unchanged" to
   setresuid). Exit 125 when it is misused or cannot pin or drop privileges (the program never
   runs), 127 when PROGRAM is not found, 126 when it cannot be executed, said as a shell says
   it ("PROGRAM: command not found"): PROGRAM is looked up here, as UID, never by root. */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#define FAILED 125

#define MAX_CPU 65535

static void usage(void) {
    fprintf(stderr,
            "usage: tangram-dropuid [-c CPUS] UID GID [NAME=VALUE...] -- PROGRAM [ARG...]\n"
            "       tangram-dropuid -k UID GID\n");
    exit(FAILED);
}

static void not_cpus(const char *s) {
    fprintf(stderr, "tangram-dropuid: not a cpulist (0-3,8): %s\n", s);
    exit(FAILED);
}

/* A CPU number at *p (decimal, at most MAX_CPU), *p moved past it. */
static unsigned long cpu_at(const char **p, const char *s) {
    const char *start = *p;
    unsigned long v = 0;
    for (; **p >= '0' && **p <= '9'; (*p)++) {
        v = v * 10 + (unsigned long)(**p - '0');
        if (v > MAX_CPU)
            not_cpus(s);
    }
    if (*p == start)
        not_cpus(s);
    return v;
}

/* Walk the cpulist s: items N or LO-HI (LO <= HI) joined by single commas; each CPU is put
   in set (when not NULL); the highest CPU is returned. */
static unsigned long walk(const char *s, cpu_set_t *set, size_t size) {
    unsigned long top = 0;
    const char *p = s;
    for (;;) {
        unsigned long lo = cpu_at(&p, s), hi = lo;
        if (*p == '-') {
            p++;
            hi = cpu_at(&p, s);
            if (hi < lo)
                not_cpus(s);
        }
        for (unsigned long v = lo; set != NULL && v <= hi; v++)
            CPU_SET_S(v, size, set);
        if (hi > top)
            top = hi;
        if (*p == '\0')
            return top;
        if (*p++ != ',')
            not_cpus(s);
    }
}

/* Pin this process to the CPUs of the cpulist s: all of it is checked before anything is set. */
static void pin(const char *s) {
    unsigned long top = walk(s, NULL, 0);
    cpu_set_t *set = CPU_ALLOC(top + 1);
    size_t size = CPU_ALLOC_SIZE(top + 1);
    if (set == NULL) {
        fprintf(stderr, "tangram-dropuid: no memory for a CPU set\n");
        exit(FAILED);
    }
    CPU_ZERO_S(size, set);
    walk(s, set, size);
    if (sched_setaffinity(0, size, set) != 0) {
        fprintf(stderr, "tangram-dropuid: cannot run on CPUs %s: %s\n", s, strerror(errno));
        exit(FAILED);
    }
    CPU_FREE(set);
}

static unsigned long id_arg(const char *s) {
    const char *p = s;
    if (*p == '\0')
        usage();
    for (; *p; p++)
        if (*p < '0' || *p > '9' || p - s > 10) {
            fprintf(stderr, "tangram-dropuid: not a uid or gid: %s\n", s);
            exit(FAILED);
        }
    unsigned long v = strtoul(s, NULL, 10);
    if (v < 1 || v > 4294967294UL) {
        fprintf(stderr, "tangram-dropuid: uid or gid out of range: %s\n", s);
        exit(FAILED);
    }
    return v;
}

/* Exec PROGRAM (args[0]) as CPython's subprocess does: a name with a slash as it is, else each
   directory of PATH (unset: /bin:/usr/bin) in turn, skipping those where it is missing; the
   first other failure is the one reported, as a shell says it. Never returns. */
__attribute__((noreturn)) static void run(char **args) {
    const char *prog = args[0];
    int err = ENOENT;
    if (strchr(prog, '/') != NULL) {
        execv(prog, args);
        err = errno;
    } else {
        const char *path = getenv("PATH");
        if (path == NULL)
            path = "/bin:/usr/bin";
        size_t n = strlen(prog);
        char *full = malloc(strlen(path) + n + 2);
        if (full == NULL) {
            fprintf(stderr, "tangram-dropuid: no memory for a path\n");
            exit(FAILED);
        }
        int saved = 0;
        for (const char *dir = path;; dir++) {
            const char *end = strchr(dir, ':');
            size_t len = end == NULL ? strlen(dir) : (size_t)(end - dir);
            memcpy(full, dir, len);
            full[len] = '\0';
            if (len > 0)
                strcat(full, "/");
            strcat(full, prog);
            execv(full, args);
            err = errno;
            if (err != ENOENT && err != ENOTDIR && saved == 0)
                saved = err;
            if (end == NULL)
                break;
            dir = end;
        }
        if (saved != 0)
            err = saved;
    }
    int missing = err == ENOENT || err == ENOTDIR;
    fprintf(stderr, "%s: %s\n", prog, missing ? "command not found" : strerror(err));
    exit(missing ? 127 : 126);
}

/* Give up root for good: no groups, then the gid, then the uid (after setresuid nothing else
   may change), then no_new_privs. Exits FAILED when any step fails. */
static void become(uid_t uid, gid_t gid) {
    if (setgroups(0, NULL) != 0 || setresgid(gid, gid, gid) != 0 ||
        setresuid(uid, uid, uid) != 0) {
        fprintf(stderr, "tangram-dropuid: cannot become %lu:%lu: %s\n", (unsigned long)uid,
                (unsigned long)gid, strerror(errno));
        exit(FAILED);
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
        fprintf(stderr, "tangram-dropuid: no_new_privs: %s\n", strerror(errno));
        exit(FAILED);
    }
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "-k") == 0) {
        if (argc != 4)
            usage();
        become((uid_t)id_arg(argv[2]), (gid_t)id_arg(argv[3]));
        if (kill(-1, SIGKILL) != 0 && errno != ESRCH) {
            fprintf(stderr, "tangram-dropuid: cannot kill the uid's processes: %s\n",
                    strerror(errno));
            return FAILED;
        }
        return 0;
    }
    if (argc >= 3 && strcmp(argv[1], "-c") == 0) {
        pin(argv[2]); /* as root still: the program never runs unpinned */
        argv[2] = argv[0];
        argv += 2;
        argc -= 2;
    }
    if (argc < 5)
        usage();
    uid_t uid = (uid_t)id_arg(argv[1]);
    gid_t gid = (gid_t)id_arg(argv[2]);
    int dash = 3;
    while (dash < argc && strcmp(argv[dash], "--") != 0) {
        const char *eq = strchr(argv[dash], '=');
        if (eq == NULL || eq == argv[dash])
            usage();
        dash++;
    }
    if (dash >= argc - 1)
        usage();
    become(uid, gid);
    for (int i = 3; i < dash; i++)
        if (putenv(argv[i]) != 0) {
            fprintf(stderr, "tangram-dropuid: cannot set %s: %s\n", argv[i], strerror(errno));
            return FAILED;
        }
    run(argv + dash + 1);
}
