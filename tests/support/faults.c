/* A storage fault for the tests, preloaded into a servex daemon (LD_PRELOAD): reads of files whose path contains
 * $SERVEX_FAULT_PATH fail while a switch file exists -- opening them with EACCES while $SERVEX_FAULT_SWITCH.eacces
 * exists, reading them (pread) with EIO while $SERVEX_FAULT_SWITCH.eio exists -- as a failing disk or a file made
 * unreadable would. Built by tests/support/faults.py with the system's C compiler. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#define MAX_FDS 4096
static char watched[MAX_FDS];

static int switched(const char *suffix) {
    const char *base = getenv("SERVEX_FAULT_SWITCH");
    char path[4096];
    if (!base) return 0;
    snprintf(path, sizeof path, "%s.%s", base, suffix);
    return access(path, F_OK) == 0;
}

static int matches(const char *path) {
    const char *match = getenv("SERVEX_FAULT_PATH");
    return match && path && strstr(path, match) != NULL;
}

static int opened(int fd, const char *path) {
    if (fd >= 0 && fd < MAX_FDS) watched[fd] = (char)matches(path);
    return fd;
}

int open(const char *path, int flags, ...) {
    static int (*real)(const char *, int, ...);
    mode_t mode = 0;
    if (flags & O_CREAT) { va_list ap; va_start(ap, flags); mode = va_arg(ap, mode_t); va_end(ap); }
    if (!real) real = dlsym(RTLD_NEXT, "open");
    if (matches(path) && switched("eacces")) { errno = EACCES; return -1; }
    return opened(real(path, flags, mode), path);
}

int open64(const char *path, int flags, ...) {
    static int (*real)(const char *, int, ...);
    mode_t mode = 0;
    if (flags & O_CREAT) { va_list ap; va_start(ap, flags); mode = va_arg(ap, mode_t); va_end(ap); }
    if (!real) real = dlsym(RTLD_NEXT, "open64");
    if (matches(path) && switched("eacces")) { errno = EACCES; return -1; }
    return opened(real(path, flags, mode), path);
}

int openat(int dir, const char *path, int flags, ...) {
    static int (*real)(int, const char *, int, ...);
    mode_t mode = 0;
    if (flags & O_CREAT) { va_list ap; va_start(ap, flags); mode = va_arg(ap, mode_t); va_end(ap); }
    if (!real) real = dlsym(RTLD_NEXT, "openat");
    if (matches(path) && switched("eacces")) { errno = EACCES; return -1; }
    return opened(real(dir, path, flags, mode), path);
}

int openat64(int dir, const char *path, int flags, ...) {
    static int (*real)(int, const char *, int, ...);
    mode_t mode = 0;
    if (flags & O_CREAT) { va_list ap; va_start(ap, flags); mode = va_arg(ap, mode_t); va_end(ap); }
    if (!real) real = dlsym(RTLD_NEXT, "openat64");
    if (matches(path) && switched("eacces")) { errno = EACCES; return -1; }
    return opened(real(dir, path, flags, mode), path);
}

static int failing(int fd) { return fd >= 0 && fd < MAX_FDS && watched[fd] && switched("eio"); }

ssize_t pread(int fd, void *buf, size_t count, off_t offset) {
    static ssize_t (*real)(int, void *, size_t, off_t);
    if (!real) real = dlsym(RTLD_NEXT, "pread");
    if (failing(fd)) { errno = EIO; return -1; }
    return real(fd, buf, count, offset);
}

ssize_t pread64(int fd, void *buf, size_t count, off_t offset) {
    static ssize_t (*real)(int, void *, size_t, off_t);
    if (!real) real = dlsym(RTLD_NEXT, "pread64");
    if (failing(fd)) { errno = EIO; return -1; }
    return real(fd, buf, count, offset);
}

ssize_t read(int fd, void *buf, size_t count) {
    static ssize_t (*real)(int, void *, size_t);
    if (!real) real = dlsym(RTLD_NEXT, "read");
    if (failing(fd)) { errno = EIO; return -1; }
    return real(fd, buf, count);
}
