package main

import (
	"io"
	"reflect"
	"strings"
	"testing"
)

// TestConfigKeys checks what docs/reference/config.md is written from:
// every key is described, and every default the loader sets, and every
// global flag it binds, is a key's.
func TestConfigKeys(t *testing.T) {
	keys, err := configKeys(reflect.TypeFor[Config]())
	if err != nil {
		t.Fatal(err)
	}
	byPath := map[string]configKey{}
	for _, k := range keys {
		byPath[k.Path] = k
	}
	for _, k := range []string{"admission.max_creating", "pools.NAME.size", "gateway.workers[].url", "gateway.kubernetes.worker.token_file"} {
		if _, ok := byPath[k]; !ok {
			t.Errorf("no key %s among %d", k, len(keys))
		}
	}
	root := newApp(strings.NewReader(""), io.Discard, io.Discard).rootCommand()
	for _, name := range configFlags {
		if k, ok := byPath[name]; !ok || k.Section || k.InMap {
			t.Errorf("configFlags has %s, not a key of Config's", name)
		}
		if root.PersistentFlags().Lookup(name) == nil {
			t.Errorf("configFlags has %s, not a global flag", name)
		}
	}
	for name := range configDefaults {
		if k, ok := byPath[name]; !ok || k.InMap || (k.Section && k.Type.Kind() != reflect.Map) {
			t.Errorf("configDefaults has %s, not a key of Config's", name)
		}
	}
	if got := configEnv("admission.max_creating"); got != "DSEC_ADMISSION_MAX_CREATING" {
		t.Errorf("configEnv(admission.max_creating) = %s", got)
	}
	if got := configEnv("log-level"); got != "DSEC_LOG_LEVEL" {
		t.Errorf("configEnv(log-level) = %s", got)
	}
}

// TestConfigKeysUndocumented checks that a key without a doc tag is an
// error, as gen-docs reports it.
func TestConfigKeysUndocumented(t *testing.T) {
	type section struct {
		A int `mapstructure:"a" doc:"an a"`
		B int `mapstructure:"b"`
	}
	type config struct {
		S section `mapstructure:"s" doc:"a section"`
	}
	if _, err := configKeys(reflect.TypeFor[config]()); err == nil || !strings.Contains(err.Error(), "config key s.b") {
		t.Fatalf("configKeys of an undescribed key: %v", err)
	}
}
