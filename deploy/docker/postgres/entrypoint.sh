#!/bin/sh
# A database `$POSTGRES_DB` owned by `$POSTGRES_USER` (password `$POSTGRES_PASSWORD`), made on the first
# start of an empty data volume; every start after that keeps what is there.
set -eu
BIN=/usr/lib/postgresql/15/bin
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  printf '%s\n' "$POSTGRES_PASSWORD" >/tmp/pw
  "$BIN/initdb" -D "$PGDATA" -U "$POSTGRES_USER" --pwfile=/tmp/pw --auth=scram-sha-256 >/dev/null
  rm -f /tmp/pw
  echo "host all all 0.0.0.0/0 scram-sha-256" >>"$PGDATA/pg_hba.conf"
  "$BIN/pg_ctl" -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
  PGPASSWORD="$POSTGRES_PASSWORD" "$BIN/psql" -U "$POSTGRES_USER" -d postgres -h /var/run/postgresql \
    -c "CREATE DATABASE \"$POSTGRES_DB\"" >/dev/null
  "$BIN/pg_ctl" -D "$PGDATA" -m fast -w stop >/dev/null
fi
exec "$BIN/postgres" -D "$PGDATA" -c listen_addresses='*'
