/*
 * A fake libnvidia-ml.so.1 for machines without a GPU.
 *
 * The real pynvml loads it with ctypes exactly as it loads NVIDIA's library, so every NVML call our code
 * makes runs through pynvml's own marshalling and error mapping. It is compiled at test time against the
 * official nvml.h (PyPI wheel nvidia-nvml-dev), which checks every signature below.
 *
 * State comes from the JSON file named by FAKE_NVML_CONFIG and is re-read whenever that file changes, so
 * a test changes GPUs, processes, errors and events of a running process by rewriting the file (atomically,
 * by rename). Shape:
 *
 *   {"driverVersion": "535.261.03", "cudaDriverVersion": 12020,
 *    "errors": {"nvmlInitWithFlags": "DRIVER_NOT_LOADED"},
 *    "devices": [{"uuid": "GPU-...", "name": "Tesla T4", "memoryMiB": 15360, "usedMiB": 0, "minor": 0,
 *                 "computeCapability": [7, 5], "migMode": 0, "computeMode": 0, "gpuUtil": 0,
 *                 "processes": [{"pid": 42, "usedMiB": 100, "smUtil": 35}, {"pid": 43, "usedMiB": 5, "kind": "graphics"}],
 *                 "pciBus": 7, "numaNode": 0, "nvlinks": [8, 8, 9, 129],
 *                 "errors": {"nvmlDeviceGetMemoryInfo": "GPU_IS_LOST"}}],
 *    "nvswitchBuses": [129, 130], "ancestors": [[0, 40], [40, 0]],
 *    "events": [{"id": 1, "device": 0, "type": "xid", "xid": 79}]}
 *
 * Topology: a GPU sits on PCI bus "pciBus" (domain 0, device 0) of NUMA node "numaNode" (absent: the
 * driver does not say, NOT_SUPPORTED); link i of its "nvlinks" is active and reaches the device on that
 * bus: another GPU, or an NVSwitch when the bus is one of "nvswitchBuses"; links past the list are not
 * there (NOT_SUPPORTED). "ancestors" is the matrix of nvmlGpuTopologyLevel_t values between GPUs
 * (absent: nvmlDeviceGetTopologyCommonAncestor answers NOT_SUPPORTED, as older drivers do).
 *
 * Errors name NVML's return codes without the NVML_ERROR_ prefix. An event is delivered once to every
 * event set that registered its type on its device before the event appeared (as with the real driver,
 * events from before registration are not replayed); "device": -1 means all devices.
 */
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_DEVICES 64
#define MAX_PROCESSES 64
#define MAX_ERRORS 32
#define MAX_EVENTS 256
#define MAX_SETS 64
#define NAME_LEN 96

/* ------------------------------------------------------------------------------------------------------ */
/* A small JSON reader: enough for the config above, strict about what it accepts.                         */

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } jtype;

typedef struct jval {
    jtype type;
    double num;
    char *str;            /* J_STR */
    struct jval **items;  /* J_ARR values, J_OBJ values */
    char **keys;          /* J_OBJ keys */
    size_t len;
} jval;

typedef struct {
    const char *p;
    int failed;
} jparser;

static void jfree(jval *v) {
    if (!v) return;
    for (size_t i = 0; i < v->len; i++) {
        jfree(v->items[i]);
        if (v->keys) free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    free(v->str);
    free(v);
}

static void jskip(jparser *jp) {
    while (*jp->p && isspace((unsigned char)*jp->p)) jp->p++;
}

static jval *jparse_value(jparser *jp);

static char *jparse_string(jparser *jp) {
    if (*jp->p != '"') { jp->failed = 1; return NULL; }
    jp->p++;
    size_t cap = 16, n = 0;
    char *out = malloc(cap);
    while (*jp->p && *jp->p != '"') {
        char c = *jp->p++;
        if (c == '\\') {
            char e = *jp->p++;
            switch (e) {
                case 'n': c = '\n'; break;
                case 't': c = '\t'; break;
                case 'r': c = '\r'; break;
                case 'b': c = '\b'; break;
                case 'f': c = '\f'; break;
                case 'u':  /* only ASCII escapes are needed here */
                    if (!jp->p[0] || !jp->p[1] || !jp->p[2] || !jp->p[3]) { jp->failed = 1; free(out); return NULL; }
                    c = (char)strtol((char[]){jp->p[0], jp->p[1], jp->p[2], jp->p[3], 0}, NULL, 16);
                    jp->p += 4;
                    break;
                case '\0': jp->failed = 1; free(out); return NULL;
                default: c = e;
            }
        }
        if (n + 2 > cap) out = realloc(out, cap *= 2);
        out[n++] = c;
    }
    if (*jp->p != '"') { jp->failed = 1; free(out); return NULL; }
    jp->p++;
    out[n] = 0;
    return out;
}

static jval *jnew(jtype type) {
    jval *v = calloc(1, sizeof *v);
    v->type = type;
    return v;
}

static void jappend(jval *v, char *key, jval *item) {
    v->items = realloc(v->items, (v->len + 1) * sizeof *v->items);
    if (v->type == J_OBJ) {
        v->keys = realloc(v->keys, (v->len + 1) * sizeof *v->keys);
        v->keys[v->len] = key;
    }
    v->items[v->len++] = item;
}

static jval *jparse_container(jparser *jp, jtype type) {
    char close = type == J_OBJ ? '}' : ']';
    jval *v = jnew(type);
    jp->p++;
    jskip(jp);
    if (*jp->p == close) { jp->p++; return v; }
    for (;;) {
        char *key = NULL;
        jskip(jp);
        if (type == J_OBJ) {
            key = jparse_string(jp);
            jskip(jp);
            if (jp->failed || *jp->p != ':') { free(key); jp->failed = 1; return v; }
            jp->p++;
        }
        jval *item = jparse_value(jp);
        jappend(v, key, item);
        if (jp->failed) return v;
        jskip(jp);
        if (*jp->p == ',') { jp->p++; continue; }
        if (*jp->p == close) { jp->p++; return v; }
        jp->failed = 1;
        return v;
    }
}

static jval *jparse_value(jparser *jp) {
    jskip(jp);
    const char *p = jp->p;
    if (*p == '{') return jparse_container(jp, J_OBJ);
    if (*p == '[') return jparse_container(jp, J_ARR);
    if (*p == '"') {
        jval *v = jnew(J_STR);
        v->str = jparse_string(jp);
        return v;
    }
    if (!strncmp(p, "true", 4) || !strncmp(p, "false", 5)) {
        jval *v = jnew(J_BOOL);
        v->num = *p == 't';
        jp->p += *p == 't' ? 4 : 5;
        return v;
    }
    if (!strncmp(p, "null", 4)) { jp->p += 4; return jnew(J_NULL); }
    char *end;
    double num = strtod(p, &end);
    if (end == p) { jp->failed = 1; return jnew(J_NULL); }
    jp->p = end;
    jval *v = jnew(J_NUM);
    v->num = num;
    return v;
}

static const jval *jget(const jval *obj, const char *key) {
    if (!obj || obj->type != J_OBJ) return NULL;
    for (size_t i = 0; i < obj->len; i++)
        if (!strcmp(obj->keys[i], key)) return obj->items[i];
    return NULL;
}

static double jnum(const jval *obj, const char *key, double fallback) {
    const jval *v = jget(obj, key);
    return v && (v->type == J_NUM || v->type == J_BOOL) ? v->num : fallback;
}

static void jstr(const jval *obj, const char *key, char *out, size_t size, const char *fallback) {
    const jval *v = jget(obj, key);
    snprintf(out, size, "%s", v && v->type == J_STR ? v->str : fallback);
}

/* ------------------------------------------------------------------------------------------------------ */
/* State                                                                                                   */

typedef struct { char function[NAME_LEN]; nvmlReturn_t code; } injected_error;

struct nvmlDevice_st {
    unsigned int index;
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    unsigned long long memory_mib, used_mib;
    unsigned int minor, mig_mode, gpu_util;
    int cc_major, cc_minor;
    nvmlComputeMode_t compute_mode;
    unsigned int process_count, graphics_count;
    nvmlProcessInfo_t processes[MAX_PROCESSES];  /* compute processes */
    int sm_util[MAX_PROCESSES];                  /* each compute process's SM use, %; -1: no sample */
    nvmlProcessInfo_t graphics[MAX_PROCESSES];
    unsigned int error_count;
    injected_error errors[MAX_ERRORS];
    unsigned int pci_bus;
    int numa_node; /* -1: not known */
    unsigned int link_count;
    unsigned int link_bus[NVML_NVLINK_MAX_LINKS];
};

typedef struct {
    long long id;
    int device; /* -1: every device */
    unsigned long long type, data;
} fake_event;

struct nvmlEventSet_st {
    int used;
    unsigned long long types[MAX_DEVICES];
    long long delivered; /* highest event id handed out or passed over */
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct nvmlDevice_st devices[MAX_DEVICES];
static unsigned int device_count;
static injected_error global_errors[MAX_ERRORS];
static unsigned int global_error_count;
static fake_event events[MAX_EVENTS];
static unsigned int event_count;
static struct nvmlEventSet_st sets[MAX_SETS];
static char driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE] = "535.261.03";
static int cuda_driver_version = 12020;
static unsigned int switch_buses[MAX_DEVICES];
static unsigned int switch_count;
static int have_ancestors;
static nvmlGpuTopologyLevel_t ancestors[MAX_DEVICES][MAX_DEVICES];
static int initialized;
static struct stat loaded_stat;
static int loaded;

static const struct { const char *name; nvmlReturn_t code; } error_names[] = {
    {"SUCCESS", NVML_SUCCESS},
    {"UNINITIALIZED", NVML_ERROR_UNINITIALIZED},
    {"INVALID_ARGUMENT", NVML_ERROR_INVALID_ARGUMENT},
    {"NOT_SUPPORTED", NVML_ERROR_NOT_SUPPORTED},
    {"NO_PERMISSION", NVML_ERROR_NO_PERMISSION},
    {"ALREADY_INITIALIZED", NVML_ERROR_ALREADY_INITIALIZED},
    {"NOT_FOUND", NVML_ERROR_NOT_FOUND},
    {"INSUFFICIENT_SIZE", NVML_ERROR_INSUFFICIENT_SIZE},
    {"INSUFFICIENT_POWER", NVML_ERROR_INSUFFICIENT_POWER},
    {"DRIVER_NOT_LOADED", NVML_ERROR_DRIVER_NOT_LOADED},
    {"TIMEOUT", NVML_ERROR_TIMEOUT},
    {"IRQ_ISSUE", NVML_ERROR_IRQ_ISSUE},
    {"LIBRARY_NOT_FOUND", NVML_ERROR_LIBRARY_NOT_FOUND},
    {"FUNCTION_NOT_FOUND", NVML_ERROR_FUNCTION_NOT_FOUND},
    {"CORRUPTED_INFOROM", NVML_ERROR_CORRUPTED_INFOROM},
    {"GPU_IS_LOST", NVML_ERROR_GPU_IS_LOST},
    {"RESET_REQUIRED", NVML_ERROR_RESET_REQUIRED},
    {"OPERATING_SYSTEM", NVML_ERROR_OPERATING_SYSTEM},
    {"LIB_RM_VERSION_MISMATCH", NVML_ERROR_LIB_RM_VERSION_MISMATCH},
    {"IN_USE", NVML_ERROR_IN_USE},
    {"MEMORY", NVML_ERROR_MEMORY},
    {"NO_DATA", NVML_ERROR_NO_DATA},
    {"UNKNOWN", NVML_ERROR_UNKNOWN},
};

static nvmlReturn_t error_code(const char *name) {
    for (size_t i = 0; i < sizeof error_names / sizeof *error_names; i++)
        if (!strcmp(error_names[i].name, name)) return error_names[i].code;
    fprintf(stderr, "fake-nvml: unknown error name %s, using UNKNOWN\n", name);
    return NVML_ERROR_UNKNOWN;
}

static unsigned int read_errors(const jval *obj, injected_error *out) {
    const jval *errs = jget(obj, "errors");
    unsigned int n = 0;
    if (!errs || errs->type != J_OBJ) return 0;
    for (size_t i = 0; i < errs->len && n < MAX_ERRORS; i++) {
        if (errs->items[i]->type != J_STR) continue;
        snprintf(out[n].function, NAME_LEN, "%s", errs->keys[i]);
        out[n++].code = error_code(errs->items[i]->str);
    }
    return n;
}

static unsigned long long event_type(const char *name) {
    if (!strcmp(name, "xid")) return nvmlEventTypeXidCriticalError;
    if (!strcmp(name, "sbe")) return nvmlEventTypeSingleBitEccError;
    if (!strcmp(name, "dbe")) return nvmlEventTypeDoubleBitEccError;
    return 0;
}

/* Re-reads the config when the file changed. Called with the lock held. */
static void reload(void) {
    const char *path = getenv("FAKE_NVML_CONFIG");
    struct stat st;
    if (!path || stat(path, &st) != 0) {
        if (!loaded && path) fprintf(stderr, "fake-nvml: cannot read %s: %s\n", path, strerror(errno));
        return;
    }
    if (loaded && st.st_ino == loaded_stat.st_ino && st.st_size == loaded_stat.st_size &&
        st.st_mtim.tv_sec == loaded_stat.st_mtim.tv_sec && st.st_mtim.tv_nsec == loaded_stat.st_mtim.tv_nsec)
        return;
    FILE *f = fopen(path, "r");
    if (!f) return;
    char *text = calloc(1, (size_t)st.st_size + 1);
    size_t got = fread(text, 1, (size_t)st.st_size, f);
    fclose(f);
    text[got] = 0;
    jparser jp = {text, 0};
    jval *root = jparse_value(&jp);
    if (jp.failed || root->type != J_OBJ) {
        /* A half-written file: keep the last good state and try again on the next call. */
        fprintf(stderr, "fake-nvml: %s is not a JSON object, keeping the previous state\n", path);
        jfree(root);
        free(text);
        return;
    }
    loaded = 1;
    loaded_stat = st;
    jstr(root, "driverVersion", driver_version, sizeof driver_version, "535.261.03");
    cuda_driver_version = (int)jnum(root, "cudaDriverVersion", 12020);
    global_error_count = read_errors(root, global_errors);

    const jval *devs = jget(root, "devices");
    device_count = 0;
    for (size_t i = 0; devs && devs->type == J_ARR && i < devs->len && i < MAX_DEVICES; i++) {
        const jval *d = devs->items[i];
        struct nvmlDevice_st *dev = &devices[device_count];
        dev->index = device_count++;
        char fallback_uuid[64];
        snprintf(fallback_uuid, sizeof fallback_uuid, "GPU-fake-%u", dev->index);
        jstr(d, "uuid", dev->uuid, sizeof dev->uuid, fallback_uuid);
        jstr(d, "name", dev->name, sizeof dev->name, "Fake GPU");
        dev->memory_mib = (unsigned long long)jnum(d, "memoryMiB", 16384);
        dev->used_mib = (unsigned long long)jnum(d, "usedMiB", 0);
        dev->minor = (unsigned int)jnum(d, "minor", dev->index);
        dev->mig_mode = (unsigned int)jnum(d, "migMode", 0);
        dev->gpu_util = (unsigned int)jnum(d, "gpuUtil", 0);
        dev->compute_mode = (nvmlComputeMode_t)jnum(d, "computeMode", NVML_COMPUTEMODE_DEFAULT);
        const jval *cc = jget(d, "computeCapability");
        dev->cc_major = cc && cc->type == J_ARR && cc->len == 2 ? (int)cc->items[0]->num : 8;
        dev->cc_minor = cc && cc->type == J_ARR && cc->len == 2 ? (int)cc->items[1]->num : 0;
        const jval *procs = jget(d, "processes");
        dev->process_count = dev->graphics_count = 0;
        for (size_t p = 0; procs && procs->type == J_ARR && p < procs->len; p++) {
            char kind[16];
            jstr(procs->items[p], "kind", kind, sizeof kind, "compute");
            int graphics = strcmp(kind, "graphics") == 0;
            unsigned int *n = graphics ? &dev->graphics_count : &dev->process_count;
            if (*n >= MAX_PROCESSES) continue;
            if (!graphics) dev->sm_util[*n] = (int)jnum(procs->items[p], "smUtil", -1);
            nvmlProcessInfo_t *info = graphics ? &dev->graphics[(*n)++] : &dev->processes[(*n)++];
            info->pid = (unsigned int)jnum(procs->items[p], "pid", 0);
            /* usedMiB -1: the driver cannot say (NVML_VALUE_NOT_AVAILABLE, as under WDDM) */
            double used = jnum(procs->items[p], "usedMiB", 0);
            info->usedGpuMemory = used < 0 ? (unsigned long long)NVML_VALUE_NOT_AVAILABLE : (unsigned long long)used << 20;
            info->gpuInstanceId = 0xFFFFFFFF;
            info->computeInstanceId = 0xFFFFFFFF;
        }
        dev->error_count = read_errors(d, dev->errors);
        dev->pci_bus = (unsigned int)jnum(d, "pciBus", 0x10 + dev->index);
        dev->numa_node = (int)jnum(d, "numaNode", -1);
        const jval *nvlinks = jget(d, "nvlinks");
        dev->link_count = 0;
        for (size_t l = 0; nvlinks && nvlinks->type == J_ARR && l < nvlinks->len && l < NVML_NVLINK_MAX_LINKS; l++)
            dev->link_bus[dev->link_count++] = (unsigned int)nvlinks->items[l]->num;
    }

    const jval *switches = jget(root, "nvswitchBuses");
    switch_count = 0;
    for (size_t i = 0; switches && switches->type == J_ARR && i < switches->len && i < MAX_DEVICES; i++)
        switch_buses[switch_count++] = (unsigned int)switches->items[i]->num;
    const jval *matrix = jget(root, "ancestors");
    have_ancestors = matrix && matrix->type == J_ARR;
    memset(ancestors, 0, sizeof ancestors);
    for (size_t a = 0; have_ancestors && a < matrix->len && a < MAX_DEVICES; a++) {
        const jval *row = matrix->items[a];
        for (size_t b = 0; row->type == J_ARR && b < row->len && b < MAX_DEVICES; b++)
            ancestors[a][b] = (nvmlGpuTopologyLevel_t)row->items[b]->num;
    }

    const jval *evs = jget(root, "events");
    event_count = 0;
    for (size_t i = 0; evs && evs->type == J_ARR && i < evs->len && i < MAX_EVENTS; i++) {
        const jval *e = evs->items[i];
        char type[16];
        jstr(e, "type", type, sizeof type, "xid");
        events[event_count].id = (long long)jnum(e, "id", (double)i + 1);
        events[event_count].device = (int)jnum(e, "device", -1);
        events[event_count].type = event_type(type);
        events[event_count].data = (unsigned long long)jnum(e, "xid", 0);
        event_count++;
    }
    jfree(root);
    free(text);
}

static nvmlReturn_t injected(const char *function, const struct nvmlDevice_st *dev) {
    for (unsigned int i = 0; dev && i < dev->error_count; i++)
        if (!strcmp(dev->errors[i].function, function)) return dev->errors[i].code;
    for (unsigned int i = 0; i < global_error_count; i++)
        if (!strcmp(global_errors[i].function, function)) return global_errors[i].code;
    return NVML_SUCCESS;
}

static int valid_device(nvmlDevice_t device) {
    return device >= devices && device < devices + device_count;
}

/* Every device call: lock, reload, check init and handle, apply an injected error. */
#define DEVICE_CALL(device)                                                      \
    pthread_mutex_lock(&lock);                                                   \
    reload();                                                                    \
    nvmlReturn_t rc = !initialized ? NVML_ERROR_UNINITIALIZED                    \
                    : !valid_device(device) ? NVML_ERROR_INVALID_ARGUMENT        \
                    : injected(__func__, device);                                \
    if (rc != NVML_SUCCESS) { pthread_mutex_unlock(&lock); return rc; }

#define DONE pthread_mutex_unlock(&lock); return NVML_SUCCESS

static nvmlReturn_t copy_string(char *out, unsigned int length, const char *value) {
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(value) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, value, strlen(value) + 1);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------------------------------------ */
/* Library                                                                                                 */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    reload();
    nvmlReturn_t rc = injected(__func__, NULL);
    if (rc == NVML_SUCCESS) initialized++;
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    nvmlReturn_t rc = initialized ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (initialized) initialized--;
    pthread_mutex_unlock(&lock);
    return rc;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    for (size_t i = 0; i < sizeof error_names / sizeof *error_names; i++)
        if (error_names[i].code == result) return error_names[i].name;
    return "UNKNOWN";
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    pthread_mutex_lock(&lock);
    reload();
    nvmlReturn_t rc = !initialized ? NVML_ERROR_UNINITIALIZED : injected(__func__, NULL);
    if (rc == NVML_SUCCESS) rc = copy_string(version, length, driver_version);
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    pthread_mutex_lock(&lock);
    reload();
    nvmlReturn_t rc = !initialized ? NVML_ERROR_UNINITIALIZED : injected(__func__, NULL);
    if (rc == NVML_SUCCESS) *version = cuda_driver_version;
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) { return nvmlSystemGetCudaDriverVersion(version); }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    pthread_mutex_lock(&lock);
    reload();
    nvmlReturn_t rc = !initialized ? NVML_ERROR_UNINITIALIZED : injected(__func__, NULL);
    if (rc == NVML_SUCCESS) *count = device_count;
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    pthread_mutex_lock(&lock);
    reload();
    nvmlReturn_t rc = !initialized ? NVML_ERROR_UNINITIALIZED
                    : index >= device_count ? NVML_ERROR_INVALID_ARGUMENT
                    : injected(__func__, &devices[index]);
    if (rc == NVML_SUCCESS) *device = &devices[index];
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    pthread_mutex_lock(&lock);
    reload();
    nvmlReturn_t rc = !initialized ? NVML_ERROR_UNINITIALIZED : NVML_ERROR_NOT_FOUND;
    for (unsigned int i = 0; initialized && i < device_count; i++) {
        if (!strcmp(devices[i].uuid, uuid)) {
            rc = injected(__func__, &devices[i]);
            if (rc == NVML_SUCCESS) *device = &devices[i];
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

/* ------------------------------------------------------------------------------------------------------ */
/* Devices                                                                                                 */

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    DEVICE_CALL(device);
    *index = device->index;
    DONE;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    DEVICE_CALL(device);
    rc = copy_string(uuid, length, device->uuid);
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    DEVICE_CALL(device);
    rc = copy_string(name, length, device->name);
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    DEVICE_CALL(device);
    *minor = device->minor;
    DONE;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    DEVICE_CALL(device);
    memory->total = device->memory_mib << 20;
    memory->used = device->used_mib << 20;
    memory->free = memory->total - memory->used;
    DONE;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    DEVICE_CALL(device);
    memory->total = device->memory_mib << 20;
    memory->reserved = 0;
    memory->used = device->used_mib << 20;
    memory->free = memory->total - memory->used;
    DONE;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    DEVICE_CALL(device);
    *current = device->mig_mode;
    *pending = device->mig_mode;
    DONE;
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    DEVICE_CALL(device);
    *major = device->cc_major;
    *minor = device->cc_minor;
    DONE;
}

nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, nvmlComputeMode_t *mode) {
    DEVICE_CALL(device);
    *mode = device->compute_mode;
    DONE;
}

/* Lives until the next config change, as the mode of a real GPU lives until a reboot or reset. */
nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t device, nvmlComputeMode_t mode) {
    DEVICE_CALL(device);
    device->compute_mode = mode;
    DONE;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    DEVICE_CALL(device);
    utilization->gpu = device->gpu_util;
    utilization->memory = device->memory_mib ? (unsigned int)(100 * device->used_mib / device->memory_mib) : 0;
    DONE;
}

/* Each compute process that has "smUtil" as one sample, stamped now; none: NOT_FOUND, as the driver
 * answers when no process ran since lastSeenTimeStamp. */
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *samples,
                                             unsigned int *count, unsigned long long lastSeenTimeStamp) {
    (void)lastSeenTimeStamp;
    DEVICE_CALL(device);
    if (!count) { pthread_mutex_unlock(&lock); return NVML_ERROR_INVALID_ARGUMENT; }
    unsigned int have = 0;
    for (unsigned int p = 0; p < device->process_count; p++) have += device->sm_util[p] >= 0;
    if (!have) { *count = 0; pthread_mutex_unlock(&lock); return NVML_ERROR_NOT_FOUND; }
    if (!samples || *count < have) { *count = have; pthread_mutex_unlock(&lock); return NVML_ERROR_INSUFFICIENT_SIZE; }
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    unsigned int n = 0;
    for (unsigned int p = 0; p < device->process_count; p++) {
        if (device->sm_util[p] < 0) continue;
        memset(&samples[n], 0, sizeof samples[n]);
        samples[n].pid = device->processes[p].pid;
        samples[n].timeStamp = (unsigned long long)now.tv_sec * 1000000ull + (unsigned long long)now.tv_nsec / 1000;
        samples[n].smUtil = (unsigned int)device->sm_util[p];
        n++;
    }
    *count = n;
    DONE;
}

static nvmlReturn_t running_processes(nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_t *infos,
                                      int graphics, const char *function) {
    pthread_mutex_lock(&lock);
    reload();
    nvmlReturn_t rc = !initialized ? NVML_ERROR_UNINITIALIZED
                      : !valid_device(device) ? NVML_ERROR_INVALID_ARGUMENT
                                              : injected(function, device);
    if (rc == NVML_SUCCESS) {
        unsigned int have = graphics ? device->graphics_count : device->process_count;
        unsigned int capacity = *count;
        *count = have;
        if (!infos || capacity < have) {
            rc = have ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
        } else {
            memcpy(infos, graphics ? device->graphics : device->processes, have * sizeof *infos);
        }
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    return running_processes(device, count, infos, 0, __func__);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                      nvmlProcessInfo_t *infos) {
    return running_processes(device, count, infos, 1, __func__);
}

/* ------------------------------------------------------------------------------------------------------ */
/* Topology                                                                                                */

static void fill_pci(nvmlPciInfo_t *pci, unsigned int bus) {
    memset(pci, 0, sizeof *pci);
    pci->bus = bus;
    pci->pciDeviceId = 0x20B010DE;
    snprintf(pci->busId, sizeof pci->busId, NVML_DEVICE_PCI_BUS_ID_FMT, 0u, bus, 0u);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT, 0u, bus, 0u);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    DEVICE_CALL(device);
    fill_pci(pci, device->pci_bus);
    DONE;
}

/* NUMA node "numaNode" is the GPU's nearest memory: one bit of the node set, at node and socket scope alike.
 * nvmlDeviceGetNumaNodeId (the node *of* the GPU's memory, Grace Hopper) answers NOT_SUPPORTED, as an H100 on
 * PCIe does. */
nvmlReturn_t nvmlDeviceGetMemoryAffinity(nvmlDevice_t device, unsigned int nodeSetSize, unsigned long *nodeSet,
                                         nvmlAffinityScope_t scope) {
    (void)scope;
    DEVICE_CALL(device);
    if (device->numa_node < 0) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_NOT_SUPPORTED;
    }
    unsigned int bits = 8 * sizeof(unsigned long);
    if (nodeSetSize * bits <= (unsigned int)device->numa_node) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memset(nodeSet, 0, nodeSetSize * sizeof(unsigned long));
    nodeSet[device->numa_node / bits] = 1UL << (device->numa_node % bits);
    DONE;
}

nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node) {
    (void)node;
    DEVICE_CALL(device);
    pthread_mutex_unlock(&lock);
    return NVML_ERROR_NOT_SUPPORTED;
}

/* A link past the ones the GPU has answers NOT_SUPPORTED, as on a real board with fewer than the maximum. */
#define LINK_CALL(device, link)                                                  \
    DEVICE_CALL(device);                                                         \
    if ((link) >= NVML_NVLINK_MAX_LINKS) {                                       \
        pthread_mutex_unlock(&lock);                                             \
        return NVML_ERROR_INVALID_ARGUMENT;                                      \
    }                                                                            \
    if ((link) >= device->link_count) {                                          \
        pthread_mutex_unlock(&lock);                                             \
        return NVML_ERROR_NOT_SUPPORTED;                                         \
    }

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *active) {
    LINK_CALL(device, link);
    *active = NVML_FEATURE_ENABLED;
    DONE;
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci) {
    LINK_CALL(device, link);
    fill_pci(pci, device->link_bus[link]);
    DONE;
}

nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                 nvmlIntNvLinkDeviceType_t *type) {
    LINK_CALL(device, link);
    *type = NVML_NVLINK_DEVICE_TYPE_UNKNOWN;
    for (unsigned int d = 0; d < device_count; d++)
        if (devices[d].pci_bus == device->link_bus[link]) *type = NVML_NVLINK_DEVICE_TYPE_GPU;
    for (unsigned int s = 0; s < switch_count; s++)
        if (switch_buses[s] == device->link_bus[link]) *type = NVML_NVLINK_DEVICE_TYPE_SWITCH;
    DONE;
}

nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                 nvmlGpuTopologyLevel_t *level) {
    DEVICE_CALL(device1);
    if (!valid_device(device2)) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (!have_ancestors) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_NOT_SUPPORTED;
    }
    *level = ancestors[device1->index][device2->index];
    DONE;
}

/* ------------------------------------------------------------------------------------------------------ */
/* Events                                                                                                  */

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *types) {
    DEVICE_CALL(device);
    *types = nvmlEventTypeXidCriticalError | nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError;
    DONE;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    pthread_mutex_lock(&lock);
    reload();
    nvmlReturn_t rc = !initialized ? NVML_ERROR_UNINITIALIZED : injected(__func__, NULL);
    if (rc == NVML_SUCCESS) {
        rc = NVML_ERROR_MEMORY;
        for (int i = 0; i < MAX_SETS; i++) {
            if (!sets[i].used) {
                memset(&sets[i], 0, sizeof sets[i]);
                sets[i].used = 1;
                long long newest = 0;
                for (unsigned int e = 0; e < event_count; e++)
                    if (events[e].id > newest) newest = events[e].id;
                sets[i].delivered = newest;
                *set = &sets[i];
                rc = NVML_SUCCESS;
                break;
            }
        }
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types, nvmlEventSet_t set) {
    DEVICE_CALL(device);
    if (!set || !set->used) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    set->types[device->index] |= types;
    DONE;
}

static int take_event(nvmlEventSet_t set, nvmlEventData_t *data) {
    long long best = -1;
    for (unsigned int e = 0; e < event_count; e++) {
        if (events[e].id > set->delivered && (best < 0 || events[e].id < events[best].id)) best = e;
    }
    while (best >= 0) {
        fake_event *ev = &events[best];
        set->delivered = ev->id;
        for (unsigned int d = 0; d < device_count; d++) {
            if ((ev->device < 0 || (unsigned int)ev->device == d) && (set->types[d] & ev->type)) {
                data->device = ev->device < 0 ? NULL : &devices[d];
                data->eventType = ev->type;
                data->eventData = ev->data;
                data->gpuInstanceId = 0xFFFFFFFF;
                data->computeInstanceId = 0xFFFFFFFF;
                return 1;
            }
        }
        best = -1;
        for (unsigned int e = 0; e < event_count; e++)
            if (events[e].id > set->delivered && (best < 0 || events[e].id < events[best].id)) best = e;
    }
    return 0;
}

/* Blocks as the real driver does: the thread sleeps until the config file is replaced (inotify on its
 * directory, since a writer renames a new file over it) or the timeout passes, never polling. */
static int watch_config(void) {
    const char *path = getenv("FAKE_NVML_CONFIG");
    if (!path) return -1;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = 0; else snprintf(dir, sizeof dir, ".");
    int fd = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
    if (fd < 0) return -1;
    if (inotify_add_watch(fd, dir[0] ? dir : "/", IN_MOVED_TO | IN_CLOSE_WRITE) < 0) { close(fd); return -1; }
    return fd;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    int fd = watch_config();  /* before the first look: a change after it still wakes us */
    for (;;) {
        pthread_mutex_lock(&lock);
        reload();
        nvmlReturn_t rc = !initialized ? NVML_ERROR_UNINITIALIZED
                        : (!set || !set->used) ? NVML_ERROR_INVALID_ARGUMENT
                        : injected(__func__, NULL);
        if (rc == NVML_SUCCESS && take_event(set, data)) {
            pthread_mutex_unlock(&lock);
            if (fd >= 0) close(fd);
            return NVML_SUCCESS;
        }
        pthread_mutex_unlock(&lock);
        clock_gettime(CLOCK_MONOTONIC, &now);
        long long waited = (now.tv_sec - start.tv_sec) * 1000LL + (now.tv_nsec - start.tv_nsec) / 1000000;
        if (rc != NVML_SUCCESS || waited >= timeoutms) {
            if (fd >= 0) close(fd);
            return rc != NVML_SUCCESS ? rc : NVML_ERROR_TIMEOUT;
        }
        if (fd < 0) {  /* no inotify: look again every 10 ms */
            struct timespec pause = {0, 10 * 1000 * 1000};
            nanosleep(&pause, NULL);
            continue;
        }
        struct pollfd wake = {fd, POLLIN, 0};
        if (poll(&wake, 1, (int)(timeoutms - waited)) > 0) {
            char drained[4096];
            while (read(fd, drained, sizeof drained) > 0) {}
        }
    }
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    pthread_mutex_lock(&lock);
    nvmlReturn_t rc = (set && set->used) ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) set->used = 0;
    pthread_mutex_unlock(&lock);
    return rc;
}
