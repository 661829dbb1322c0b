/* A stand-in for the NVIDIA driver's libcuda.so.1 on a machine without one, answering only the
 * calls the installer's detection makes (installer/detect/detect.py, probe_driver) and the loader's check
 * of the install record (cudelta/_native.py, this_machine: the same calls). The GPU machine runs
 * the same detection against the real driver; this lets the end-to-end installs here exercise
 * the "driver visible" choice. Configured by environment:
 *   CUDELTA_FAKE_DRIVER_VERSION  cuDriverGetVersion's answer, e.g. 13000 (default)
 *   CUDELTA_FAKE_GPUS            compute capabilities, e.g. "9.0,8.0" (default "9.0"; "" = none)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GPUS 16
static int n_gpus = -1, majors[MAX_GPUS], minors[MAX_GPUS];

static void load(void) {
    if (n_gpus >= 0) return;
    const char *spec = getenv("CUDELTA_FAKE_GPUS");
    if (spec == NULL) spec = "9.0";
    n_gpus = 0;
    while (*spec && n_gpus < MAX_GPUS) {
        int major, minor, used = 0;
        if (sscanf(spec, "%d.%d%n", &major, &minor, &used) != 2) break;
        majors[n_gpus] = major;
        minors[n_gpus++] = minor;
        spec += used;
        if (*spec == ',') spec++;
    }
}

int cuDriverGetVersion(int *version) {
    const char *v = getenv("CUDELTA_FAKE_DRIVER_VERSION");
    *version = v ? atoi(v) : 13000;
    return 0;
}

int cuInit(unsigned flags) {
    (void)flags;
    load();
    return n_gpus == 0 ? 100 /* CUDA_ERROR_NO_DEVICE */ : 0;
}

int cuDeviceGetCount(int *count) { load(); *count = n_gpus; return 0; }

int cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return ordinal < n_gpus ? 0 : 101; }

int cuDeviceGetName(char *name, int len, int dev) {
    snprintf(name, (size_t)len, "Fake GPU %d.%d", majors[dev], minors[dev]);
    return 0;
}

int cuDeviceGetAttribute(int *value, int attribute, int dev) {
    if (attribute == 75) { *value = majors[dev]; return 0; }
    if (attribute == 76) { *value = minors[dev]; return 0; }
    return 1;
}

int cuGetErrorName(int code, const char **name) { (void)code; *name = "CUDA_ERROR_FAKE"; return 0; }
