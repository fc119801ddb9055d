package main

import (
	"fmt"
	"reflect"
	"strings"
	"time"
)

// configEnvReplacer makes a key's DSEC_* variable of its path: the
// loader's (viper's env key replacer) and the reference's.
var configEnvReplacer = strings.NewReplacer("-", "_", ".", "_")

// configEnv is the variable the loader reads a key from.
func configEnv(key string) string {
	return "DSEC_" + strings.ToUpper(configEnvReplacer.Replace(key))
}

// configKey is a key of the config file, as its mapstructure tags name
// it: a setting, or a section whose keys follow it (a struct, a map of
// them by name, a list of them).
type configKey struct {
	Path  string // admission.max_creating, pools.NAME.size, gateway.workers[].url
	Type  reflect.Type
	Field reflect.StructField
	// Section: its keys follow (Path.KEY, Path.NAME.KEY or Path[].KEY).
	Section bool
	// InMap: it is a key of an entry of a map or a list, which only the
	// config file gives.
	InMap bool
}

// configKeys walks t's fields, Config's and those of the structs under
// it, in their order: every field needs a mapstructure tag and a doc
// tag, its line in docs/reference/config.md.
func configKeys(t reflect.Type) ([]configKey, error) {
	var out []configKey
	var walk func(t reflect.Type, prefix string, inMap bool) error
	walk = func(t reflect.Type, prefix string, inMap bool) error {
		for i := range t.NumField() {
			f := t.Field(i)
			name := f.Tag.Get("mapstructure")
			if name == "" {
				return fmt.Errorf("config field %s.%s has no mapstructure tag: name its key", t.Name(), f.Name)
			}
			path := prefix + name
			if strings.TrimSpace(f.Tag.Get("doc")) == "" {
				return fmt.Errorf("config key %s (%s.%s) has no doc tag: describe it in a line, doc:\"...\"", path, t.Name(), f.Name)
			}
			k := configKey{Path: path, Type: f.Type, Field: f, InMap: inMap}
			var err error
			switch ft := f.Type; {
			case ft.Kind() == reflect.Struct && ft != reflect.TypeFor[time.Duration]():
				k.Section = true
				out = append(out, k)
				err = walk(ft, path+".", inMap)
			case ft.Kind() == reflect.Map && ft.Elem().Kind() == reflect.Struct:
				k.Section = true
				out = append(out, k)
				err = walk(ft.Elem(), path+".NAME.", true)
			case ft.Kind() == reflect.Slice && ft.Elem().Kind() == reflect.Struct:
				k.Section = true
				out = append(out, k)
				err = walk(ft.Elem(), path+"[].", true)
			default:
				out = append(out, k)
			}
			if err != nil {
				return err
			}
		}
		return nil
	}
	return out, walk(t, "", false)
}
